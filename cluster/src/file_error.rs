//! An I/O failure on a file, told by the file and what was being done to
//! it (`/usr/local/vgpu/ld.so.preload: rename`), the cause kept as its
//! source: the one shape the node agents' and the `vgpu` command's file
//! errors take, so that each error type wraps it instead of repeating the
//! fields and the helper that fills them.

use std::path::{Path, PathBuf};
use thiserror::Error;

#[derive(Debug, Error)]
#[error("{path}: {op}")]
pub struct FileError {
    pub path: PathBuf,
    /// What was being done: `create directory`, `chmod`, `rename`, ...
    pub op: &'static str,
    #[source]
    pub source: std::io::Error,
}

/// A `map_err` argument turning an I/O error on `path` into a
/// [`FileError`] (and, through `?`, into any error that wraps one).
pub fn io_error(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> FileError {
    let path = path.to_path_buf();
    move |source| FileError { path, op, source }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::with_causes;

    #[test]
    fn the_file_and_the_operation_come_first_and_the_cause_is_kept() {
        let error = io_error(Path::new("/x/y"), "rename")(std::io::Error::other("disk full"));
        assert_eq!(error.to_string(), "/x/y: rename");
        assert_eq!(with_causes(&error), "/x/y: rename: disk full");
        assert_eq!(error.path, Path::new("/x/y"));
    }
}
