//! Logging to standard error (never standard output: programs such as
//! `nvidia-smi --format=csv` are parsed by other programs).

use tracing::level_filters::LevelFilter;

/// Installs the shim's subscriber. `level` is `LIBCUDA_LOG_LEVEL`:
/// 0 errors, 1 warnings (default), 2 info, 3 debug, 4 trace.
pub fn init(level: u8) {
    let filter = match level {
        0 => LevelFilter::ERROR,
        1 => LevelFilter::WARN,
        2 => LevelFilter::INFO,
        3 => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    };
    // A second call (cannot happen: callers go through a OnceLock) would
    // only fail to replace the subscriber, which is harmless.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(filter)
        .with_target(false)
        .without_time()
        .with_ansi(false)
        .try_init();
}
