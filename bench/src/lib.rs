//! What the shim's benchmarks measured, kept as JSON so that their tables
//! and plots can be made again without running them: the compute-share
//! accuracy sweep (`vgpu-accuracy`) and the shim's cost against the driver
//! alone (`vgpu-bench`). Both binaries save with `--save` and plot with
//! `--plot`; `vgpu-plot` renders a saved file.
//!
//! Plots are SVG drawn by `plotters` without any font library: text goes
//! into the SVG as `<text>` and the viewer's fonts draw it.

pub mod accuracy;
pub mod overhead;
pub mod plot;
pub mod saved;

pub use accuracy::{AccuracyCase, AccuracyResults, SimulatedGpu, TenantCase};
pub use overhead::{CallCost, OverheadResults, Percentiles, StartUpCost};
pub use plot::PlotError;
pub use saved::{RunInfo, SavedError, SavedResults};
