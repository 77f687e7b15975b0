//! Saved results: one JSON file per run, tagged with the benchmark that
//! made it.

use crate::plot::PlotError;
use crate::{AccuracyResults, OverheadResults};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Why saved results could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum SavedError {
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} does not hold saved vgpu-bench or vgpu-accuracy results", path.display())]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("cannot write {}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot encode the results as JSON")]
    Encode(#[source] serde_json::Error),
    #[error("cannot plot the results")]
    Plot(#[from] PlotError),
}

/// When and how a benchmark ran, saved with its results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    /// The command line, the program's file name first.
    pub command: String,
    /// When the run finished, in UTC (`YYYY-MM-DDTHH:MM:SSZ`).
    pub finished_utc: String,
    /// CPUs the benchmark could run on.
    pub cpus: usize,
}

impl RunInfo {
    /// This process's command line and CPUs, finished now.
    pub fn of_this_process() -> Self {
        let mut args = std::env::args();
        let program = args
            .next()
            .map(|path| {
                Path::new(&path)
                    .file_name()
                    .map(|name| name.to_string_lossy().into_owned())
                    .unwrap_or(path)
            })
            .unwrap_or_default();
        let command = std::iter::once(program)
            .chain(args)
            .collect::<Vec<_>>()
            .join(" ");
        let seconds = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|since| since.as_secs())
            .unwrap_or(0);
        RunInfo {
            command,
            finished_utc: utc_timestamp(seconds),
            cpus: std::thread::available_parallelism()
                .map(|count| count.get())
                .unwrap_or(1),
        }
    }
}

/// `seconds` after the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_timestamp(seconds: u64) -> String {
    let (days, second_of_day) = (seconds / 86_400, seconds % 86_400);
    // Civil date from a day count: shift the epoch to 0000-03-01 so that a
    // leap day falls at the end of its 400-year era's year.
    let day_number = days as i64 + 719_468;
    let era = day_number.div_euclid(146_097);
    let day_of_era = day_number.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        second_of_day / 3_600,
        second_of_day / 60 % 60,
        second_of_day % 60
    )
}

/// One benchmark's saved results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "benchmark", rename_all = "snake_case")]
pub enum SavedResults {
    /// From `vgpu-accuracy`.
    Accuracy(AccuracyResults),
    /// From `vgpu-bench`.
    Overhead(OverheadResults),
}

impl SavedResults {
    /// Reads results saved by [`SavedResults::save`].
    pub fn load(path: &Path) -> Result<Self, SavedError> {
        let text = std::fs::read_to_string(path).map_err(|source| SavedError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| SavedError::Parse {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Writes the results as indented JSON, creating the directory.
    pub fn save(&self, path: &Path) -> Result<(), SavedError> {
        let mut text = serde_json::to_string_pretty(self).map_err(SavedError::Encode)?;
        text.push('\n');
        write_creating_directory(path, &text).map_err(|source| SavedError::Write {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Writes the results' plot as SVG, creating the directory.
    pub fn save_plot(&self, path: &Path) -> Result<(), SavedError> {
        let svg = self.plot_svg()?;
        write_creating_directory(path, &svg).map_err(|source| SavedError::Write {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The results' plot, as an SVG document.
    pub fn plot_svg(&self) -> Result<String, PlotError> {
        match self {
            SavedResults::Accuracy(results) => results.plot_svg(),
            SavedResults::Overhead(results) => results.plot_svg(),
        }
    }

    /// The Markdown tables the benchmark printed.
    pub fn tables(&self) -> String {
        match self {
            SavedResults::Accuracy(results) => results.tables(),
            SavedResults::Overhead(results) => results.table(),
        }
    }

    /// When and how the benchmark ran.
    pub fn run(&self) -> &RunInfo {
        match self {
            SavedResults::Accuracy(results) => &results.run,
            SavedResults::Overhead(results) => &results.run,
        }
    }
}

/// Writes `text` to `path`, creating its directory first.
pub fn write_creating_directory(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(directory) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        std::fs::create_dir_all(directory)?;
    }
    std::fs::write(path, text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AccuracyCase, SimulatedGpu, TenantCase};

    #[test]
    fn timestamps_are_civil_utc_dates() {
        assert_eq!(utc_timestamp(0), "1970-01-01T00:00:00Z");
        // A leap day, the last second of a leap year, and a date after 2100.
        assert_eq!(utc_timestamp(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_timestamp(1_483_228_799), "2016-12-31T23:59:59Z");
        assert_eq!(utc_timestamp(4_107_542_400), "2100-03-01T00:00:00Z");
        assert_eq!(utc_timestamp(1_795_552_496), "2026-11-24T20:34:56Z");
    }

    #[test]
    fn saved_results_read_back_equal() {
        let results = SavedResults::Accuracy(AccuracyResults {
            run: RunInfo {
                command: "vgpu-accuracy --quick".into(),
                finished_utc: utc_timestamp(0),
                cpus: 2,
            },
            gpu: SimulatedGpu {
                timing: "wall".into(),
                kernel_jitter_percent: 5.0,
                launch_overhead_us: 4.0,
            },
            window_seconds: 2.0,
            cases: vec![AccuracyCase {
                limit: 25,
                pattern: "burst".into(),
                kernel: "k1ms".into(),
                achieved: 24.99,
                first_second: 30.5,
            }],
            tenants: vec![TenantCase {
                pattern: "burst".into(),
                kernel: "k200us".into(),
                limits: vec![30, 70],
                achieved: vec![30.1, 69.8],
            }],
        });
        let dir = std::env::temp_dir().join(format!("vgpu-saved-{}", std::process::id()));
        let path = dir.join("nested").join("accuracy.json");
        results.save(&path).expect("save");
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(text.contains("\"benchmark\": \"accuracy\""), "{text}");
        assert_eq!(SavedResults::load(&path).expect("load"), results);
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn files_that_are_not_results_are_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("vgpu-not-saved-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("other.json");
        std::fs::write(&path, r#"{"benchmark": "monitor"}"#).expect("write");
        let error = SavedResults::load(&path).expect_err("not results");
        assert!(matches!(error, SavedError::Parse { .. }), "{error:?}");
        assert!(error.to_string().contains("other.json"), "{error}");
        let missing = SavedResults::load(&dir.join("missing.json")).expect_err("missing");
        assert!(matches!(missing, SavedError::Read { .. }), "{missing:?}");
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
