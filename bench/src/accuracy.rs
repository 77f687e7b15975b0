//! The compute-share accuracy sweep's results: achieved share against the
//! target for every limit, launch pattern and kernel length.

use crate::plot::{PlotError, FONT, REFERENCE_COLOR, SERIES_COLORS};
use crate::RunInfo;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// Cases within this many points of their target count as holding.
pub const WITHIN_POINTS: f64 = 1.0;
/// The looser bound the tables also count (what the README's first tables
/// held to).
pub const WITHIN_POINTS_LOOSE: f64 = 2.0;

/// The horizontal axis' description.
pub const TARGET_AXIS: &str = "target share (%)";
/// The vertical axis' description.
pub const ACHIEVED_AXIS: &str = "achieved share (%)";
/// The ideal line's legend.
pub const IDEAL_LABEL: &str = "ideal: achieved = target";

/// A run of the sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AccuracyResults {
    pub run: RunInfo,
    /// How the simulated GPU ran kernels (results saved before this was
    /// recorded ran the default timeline timing).
    #[serde(default)]
    pub gpu: SimulatedGpu,
    /// The measured window after a 1 s start, in seconds.
    pub window_seconds: f64,
    pub cases: Vec<AccuracyCase>,
    /// Several containers sharing one device.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantCase>,
}

/// How the simulated GPU timed kernels (`SIMGPU_TIMING`,
/// `SIMGPU_KERNEL_JITTER`, `SIMGPU_LAUNCH_OVERHEAD`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimulatedGpu {
    /// `timeline` or `wall`.
    pub timing: String,
    /// A kernel's run-to-run spread either way, in percent.
    pub kernel_jitter_percent: f64,
    /// Host time a launch call spends, in microseconds.
    pub launch_overhead_us: f64,
}

impl Default for SimulatedGpu {
    fn default() -> Self {
        Self {
            timing: "timeline".into(),
            kernel_jitter_percent: 0.0,
            launch_overhead_us: 0.0,
        }
    }
}

impl SimulatedGpu {
    /// `timeline timing` or `wall timing, kernels ±5 %, 4 us launches`.
    pub fn describe(&self) -> String {
        let mut text = format!("{} timing", self.timing);
        if self.kernel_jitter_percent > 0.0 {
            let _ = write!(text, ", kernels ±{} %", self.kernel_jitter_percent);
        }
        if self.launch_overhead_us > 0.0 {
            let _ = write!(text, ", {} us launches", self.launch_overhead_us);
        }
        text
    }
}

/// Containers on one device, each saturating it at its own limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantCase {
    /// The launch pattern every container runs.
    pub pattern: String,
    /// The kernel length.
    pub kernel: String,
    /// Each container's limit, in percent.
    pub limits: Vec<u32>,
    /// The device time each got over the window, in percent.
    pub achieved: Vec<f64>,
}

impl TenantCase {
    /// The largest of the containers' errors, in points.
    pub fn largest_error(&self) -> f64 {
        self.limits
            .iter()
            .zip(&self.achieved)
            .map(|(&limit, &achieved)| (achieved - f64::from(limit)).abs())
            .fold(0.0, f64::max)
    }
}

/// One workload alone at one limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AccuracyCase {
    /// The target share, in percent of the device.
    pub limit: u32,
    /// The launch pattern (burst, sync, streams, graph).
    pub pattern: String,
    /// The kernel length (k20us, k1ms, k30ms).
    pub kernel: String,
    /// The device time the process got over the window, in percent.
    pub achieved: f64,
    /// The same over the first second.
    pub first_second: f64,
}

impl AccuracyCase {
    /// Achieved minus target, in points.
    pub fn error(&self) -> f64 {
        self.achieved - f64::from(self.limit)
    }
}

/// The pattern name of a case run with launches that block
/// (`CUDA_LAUNCH_BLOCKING=1`): a panel of its own in the grid and plot.
pub fn blocking_pattern(pattern: &str) -> String {
    format!("{pattern}{BLOCKING_SUFFIX}")
}

const BLOCKING_SUFFIX: &str = " (blocking)";

/// How much further from its limit a blocking case may be than its
/// ordinary twin before it counts as worse (the run-to-run noise of one
/// case on a quiet 2-core machine).
pub const BLOCKING_WORSE_POINTS: f64 = 0.5;

/// A kernel's name without the `k` the workload program takes (`k20us`
/// reads `20us`).
fn kernel_label(kernel: &str) -> &str {
    kernel.strip_prefix('k').unwrap_or(kernel)
}

/// A pattern's panel caption.
pub fn panel_caption(pattern: &str) -> String {
    format!("pattern: {pattern}")
}

/// The legend of a kernel length's series.
pub fn series_label(kernel: &str) -> String {
    format!("{} kernels", kernel_label(kernel))
}

/// The distinct values of `key` over `cases`, in the order first seen.
fn distinct<'a>(
    cases: &'a [AccuracyCase],
    key: impl Fn(&'a AccuracyCase) -> &'a str,
) -> Vec<&'a str> {
    let mut seen: Vec<&str> = Vec::new();
    for case in cases {
        let value = key(case);
        if !seen.contains(&value) {
            seen.push(value);
        }
    }
    seen
}

impl AccuracyResults {
    /// Launch patterns, in the order the sweep ran them.
    pub fn patterns(&self) -> Vec<&str> {
        distinct(&self.cases, |case| &case.pattern)
    }

    /// Kernel lengths, in the order the sweep ran them.
    pub fn kernels(&self) -> Vec<&str> {
        distinct(&self.cases, |case| &case.kernel)
    }

    /// Limits, in increasing order.
    pub fn limits(&self) -> Vec<u32> {
        let mut limits: Vec<u32> = self.cases.iter().map(|case| case.limit).collect();
        limits.sort_unstable();
        limits.dedup();
        limits
    }

    /// One row per case, then how many held within [`WITHIN_POINTS`] and
    /// the largest error; then the achieved shares as a grid of pattern
    /// and kernel against limit.
    pub fn tables(&self) -> String {
        let mut out = String::new();
        out.push_str("| limit | pattern | kernel | achieved | error | first second |\n");
        out.push_str("|---:|---|---|---:|---:|---:|\n");
        for case in &self.cases {
            let _ = writeln!(
                out,
                "| {} % | {} | {} | {:.2} % | {:+.2} | {:.1} % |",
                case.limit,
                case.pattern,
                case.kernel,
                case.achieved,
                case.error(),
                case.first_second
            );
        }
        let within = |points: f64| {
            self.cases
                .iter()
                .filter(|case| case.error().abs() <= points)
                .count()
        };
        let largest = self
            .cases
            .iter()
            .max_by(|a, b| a.error().abs().total_cmp(&b.error().abs()));
        let _ = writeln!(
            out,
            "\n{} of {} cases within {WITHIN_POINTS} point, {} within {WITHIN_POINTS_LOOSE}; largest error {:.2} points ({})\n",
            within(WITHIN_POINTS),
            self.cases.len(),
            within(WITHIN_POINTS_LOOSE),
            largest.map(|case| case.error().abs()).unwrap_or(0.0),
            largest
                .map(|case| format!("{} {} {}", case.limit, case.pattern, case.kernel))
                .unwrap_or_else(|| "-".into())
        );
        out.push_str(&self.grid());
        if !self.tenants.is_empty() {
            out.push('\n');
            out.push_str(&self.tenant_table());
        }
        out
    }

    /// Each case run with ordinary launches beside the same case with
    /// blocking ones ([`blocking_pattern`]): how far each was from its
    /// limit, and how many of the blocking cases were further.
    pub fn blocking_table(&self) -> String {
        let mut out = String::from(
            "| limit | pattern | kernel | ordinary | blocking | error ordinary | error blocking |\n",
        );
        out.push_str("|---:|---|---|---:|---:|---:|---:|\n");
        let (mut pairs, mut worse) = (0, 0);
        for ordinary in self
            .cases
            .iter()
            .filter(|case| !case.pattern.ends_with(BLOCKING_SUFFIX))
        {
            let twin = blocking_pattern(&ordinary.pattern);
            let Some(blocking) = self.cases.iter().find(|case| {
                case.pattern == twin
                    && case.limit == ordinary.limit
                    && case.kernel == ordinary.kernel
            }) else {
                continue;
            };
            pairs += 1;
            if blocking.error().abs() > ordinary.error().abs() + BLOCKING_WORSE_POINTS {
                worse += 1;
            }
            let _ = writeln!(
                out,
                "| {} % | {} | {} | {:.2} % | {:.2} % | {:+.2} | {:+.2} |",
                ordinary.limit,
                ordinary.pattern,
                ordinary.kernel,
                ordinary.achieved,
                blocking.achieved,
                ordinary.error(),
                blocking.error()
            );
        }
        let _ = writeln!(
            out,
            "\n{worse} of {pairs} cases with blocking launches further from their limit than with ordinary ones by more than {BLOCKING_WORSE_POINTS} points"
        );
        out
    }

    /// Containers sharing a device: one row per set.
    pub fn tenant_table(&self) -> String {
        let mut out =
            String::from("| containers | pattern | kernel | limits | achieved | largest error |\n");
        out.push_str("|---:|---|---|---|---|---:|\n");
        let join = |values: Vec<String>| values.join(" / ");
        for case in &self.tenants {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {:.2} |",
                case.limits.len(),
                case.pattern,
                kernel_label(&case.kernel),
                join(case.limits.iter().map(|l| format!("{l} %")).collect()),
                join(case.achieved.iter().map(|a| format!("{a:.2} %")).collect()),
                case.largest_error()
            );
        }
        out
    }

    /// Achieved shares, one row per pattern and kernel and one column per
    /// limit, as the README shows them.
    pub fn grid(&self) -> String {
        let limits = self.limits();
        let mut out = String::from("| pattern | kernel |");
        for limit in &limits {
            let _ = write!(out, " {limit} % |");
        }
        out.push_str("\n|---|---|");
        out.push_str(&"---:|".repeat(limits.len()));
        out.push('\n');
        for pattern in self.patterns() {
            for kernel in self.kernels() {
                let _ = write!(out, "| {pattern} | {} |", kernel_label(kernel));
                for limit in &limits {
                    let case = self.cases.iter().find(|case| {
                        case.limit == *limit && case.pattern == pattern && case.kernel == kernel
                    });
                    match case {
                        Some(case) => {
                            let _ = write!(out, " {:.2} |", case.achieved);
                        }
                        None => out.push_str(" - |"),
                    }
                }
                out.push('\n');
            }
        }
        out
    }

    /// Achieved share against target, one panel per launch pattern with a
    /// line and points per kernel length and the ideal line, as SVG.
    pub fn plot_svg(&self) -> Result<String, PlotError> {
        let patterns = self.patterns();
        let kernels = self.kernels();
        if patterns.is_empty() {
            return Err(PlotError::NoData("accuracy cases"));
        }
        let columns = patterns.len().min(2);
        let rows = patterns.len().div_ceil(columns);
        let (panel_width, panel_height, title_height) = (520u32, 440u32, 60u32);
        // Shares above 100 % cannot happen, but a plot must still show one.
        let top = self
            .cases
            .iter()
            .map(|case| case.achieved)
            .fold(100.0f64, f64::max);
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(
                &mut svg,
                (
                    panel_width * columns as u32,
                    panel_height * rows as u32 + title_height,
                ),
            )
            .into_drawing_area();
            root.fill(&WHITE)?;
            let (title, body) = root.split_vertically(title_height);
            title.titled(
                "Compute share achieved against the target, by launch pattern",
                (FONT, 22),
            )?;
            title.draw(&Text::new(
                format!(
                    "simulated GPU ({}); one workload alone; {:.0} s window after a 1 s start",
                    self.gpu.describe(),
                    self.window_seconds
                ),
                (10, 38),
                (FONT, 15),
            ))?;
            let panels = body.split_evenly((rows, columns));
            for (panel, pattern) in panels.iter().zip(&patterns) {
                let mut chart = ChartBuilder::on(panel)
                    .caption(panel_caption(pattern), (FONT, 18))
                    .margin(12)
                    .x_label_area_size(45)
                    .y_label_area_size(55)
                    .build_cartesian_2d(0f64..100f64, 0f64..top)?;
                chart
                    .configure_mesh()
                    .x_desc(TARGET_AXIS)
                    .y_desc(ACHIEVED_AXIS)
                    .x_label_formatter(&|share| format!("{share:.0}"))
                    .y_label_formatter(&|share| format!("{share:.0}"))
                    .label_style((FONT, 13))
                    .axis_desc_style((FONT, 14))
                    .light_line_style(WHITE.mix(0.0))
                    .draw()?;
                chart
                    .draw_series(LineSeries::new(
                        [(0.0, 0.0), (100.0, 100.0)],
                        REFERENCE_COLOR.stroke_width(1),
                    ))?
                    .label(IDEAL_LABEL)
                    .legend(|(x, y)| {
                        PathElement::new([(x, y), (x + 20, y)], REFERENCE_COLOR.stroke_width(1))
                    });
                for (index, kernel) in kernels.iter().enumerate() {
                    let color = SERIES_COLORS[index % SERIES_COLORS.len()];
                    let mut points: Vec<(f64, f64)> = self
                        .cases
                        .iter()
                        .filter(|case| case.pattern == *pattern && case.kernel == *kernel)
                        .map(|case| (f64::from(case.limit), case.achieved))
                        .collect();
                    if points.is_empty() {
                        continue;
                    }
                    points.sort_by(|a, b| a.0.total_cmp(&b.0));
                    chart
                        .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
                        .label(series_label(kernel))
                        .legend(move |(x, y)| {
                            PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
                        });
                    chart.draw_series(
                        points
                            .into_iter()
                            .map(|point| Circle::new(point, 4, color.filled())),
                    )?;
                }
                chart
                    .configure_series_labels()
                    .position(SeriesLabelPosition::UpperLeft)
                    .label_font((FONT, 13))
                    .background_style(WHITE.mix(0.9))
                    .border_style(REFERENCE_COLOR)
                    .draw()?;
            }
            root.present()?;
        }
        Ok(svg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::svg_color;
    use crate::saved::utc_timestamp;

    fn case(limit: u32, pattern: &str, kernel: &str, achieved: f64) -> AccuracyCase {
        AccuracyCase {
            limit,
            pattern: pattern.into(),
            kernel: kernel.into(),
            achieved,
            first_second: achieved + 1.0,
        }
    }

    /// Two patterns, two kernels, three limits; graph's 30 ms kernels miss.
    fn known() -> AccuracyResults {
        let mut cases = Vec::new();
        for limit in [10, 50, 90] {
            for pattern in ["burst", "graph"] {
                for kernel in ["k1ms", "k30ms"] {
                    let achieved = if pattern == "graph" && kernel == "k30ms" && limit == 10 {
                        20.0
                    } else {
                        f64::from(limit) - 0.25
                    };
                    cases.push(case(limit, pattern, kernel, achieved));
                }
            }
        }
        AccuracyResults {
            run: RunInfo {
                command: "vgpu-accuracy".into(),
                finished_utc: utc_timestamp(0),
                cpus: 2,
            },
            gpu: SimulatedGpu::default(),
            window_seconds: 10.0,
            cases,
            tenants: Vec::new(),
        }
    }

    fn texts(document: &roxmltree::Document) -> Vec<String> {
        document
            .descendants()
            .filter(|node| node.has_tag_name("text"))
            .map(|node| node.text().unwrap_or_default().trim().to_string())
            .collect()
    }

    fn count(document: &roxmltree::Document, tag: &str, attribute: &str, value: &str) -> usize {
        document
            .descendants()
            .filter(|node| node.has_tag_name(tag) && node.attribute(attribute) == Some(value))
            .count()
    }

    #[test]
    fn tables_count_cases_within_one_and_two_points_and_grid_by_limit() {
        let mut results = known();
        results.cases[0].achieved = f64::from(results.cases[0].limit) + 1.5;
        let tables = results.tables();
        assert!(
            tables.contains("| 10 % | graph | k30ms | 20.00 % | +10.00 | 21.0 % |"),
            "{tables}"
        );
        assert!(
            tables.contains(
                "10 of 12 cases within 1 point, 11 within 2; largest error 10.00 points (10 graph k30ms)"
            ),
            "{tables}"
        );
        assert!(!tables.contains("containers"), "no tenants, no table");
        assert!(
            tables
                .contains("| pattern | kernel | 10 % | 50 % | 90 % |\n|---|---|---:|---:|---:|\n"),
            "{tables}"
        );
        assert!(
            tables.contains("| graph | 30ms | 20.00 | 49.75 | 89.75 |"),
            "{tables}"
        );
    }

    #[test]
    fn tenants_have_a_row_each_with_their_largest_error() {
        let mut results = known();
        results.tenants = vec![
            TenantCase {
                pattern: "burst".into(),
                kernel: "k1ms".into(),
                limits: vec![30, 70],
                achieved: vec![30.25, 69.5],
            },
            TenantCase {
                pattern: "sync".into(),
                kernel: "k200us".into(),
                limits: vec![25, 25, 25, 25],
                achieved: vec![24.9, 25.0, 25.1, 24.25],
            },
        ];
        let tables = results.tables();
        assert!(
            tables.contains("| 2 | burst | 1ms | 30 % / 70 % | 30.25 % / 69.50 % | 0.50 |"),
            "{tables}"
        );
        assert!(
            tables.contains(
                "| 4 | sync | 200us | 25 % / 25 % / 25 % / 25 % | 24.90 % / 25.00 % / 25.10 % / 24.25 % | 0.75 |"
            ),
            "{tables}"
        );
    }

    #[test]
    fn results_saved_before_the_gpu_was_recorded_read_as_timeline_timing() {
        let mut json = serde_json::to_value(known()).expect("encode");
        let object = json.as_object_mut().expect("an object");
        object.remove("gpu");
        object.remove("tenants");
        let read: AccuracyResults = serde_json::from_value(json).expect("decode");
        assert_eq!(read.gpu, SimulatedGpu::default());
        assert_eq!(read.gpu.describe(), "timeline timing");
        assert!(read.tenants.is_empty());
        let wall = SimulatedGpu {
            timing: "wall".into(),
            kernel_jitter_percent: 5.0,
            launch_overhead_us: 4.0,
        };
        assert_eq!(wall.describe(), "wall timing, kernels ±5 %, 4 us launches");
    }

    #[test]
    fn grid_marks_cases_not_run() {
        let mut results = known();
        results
            .cases
            .retain(|case| !(case.limit == 50 && case.pattern == "burst" && case.kernel == "k1ms"));
        assert!(
            results
                .grid()
                .contains("| burst | 1ms | 9.75 | - | 89.75 |"),
            "{}",
            results.grid()
        );
    }

    #[test]
    fn plot_has_a_panel_per_pattern_a_series_per_kernel_and_the_ideal_line() {
        let svg = known().plot_svg().expect("plot");
        let document = roxmltree::Document::parse(&svg).expect("well-formed SVG");
        assert!(document.root_element().has_tag_name("svg"));
        let texts = texts(&document);
        for wanted in [
            "pattern: burst",
            "pattern: graph",
            "1ms kernels",
            "30ms kernels",
        ] {
            assert_eq!(
                texts.iter().filter(|t| *t == wanted).count(),
                if wanted.starts_with("pattern") { 1 } else { 2 },
                "{wanted}: {texts:?}"
            );
        }
        for axis in [
            "target share (%)",
            "achieved share (%)",
            "ideal: achieved = target",
        ] {
            assert_eq!(
                texts.iter().filter(|t| *t == axis).count(),
                2,
                "{axis}: {texts:?}"
            );
        }
        // Per panel and kernel: one line through its three points, and the
        // legend's sample line.
        for (index, points) in [(0, 6), (1, 6)] {
            let color = svg_color(SERIES_COLORS[index]);
            assert_eq!(
                count(&document, "circle", "fill", &color),
                points,
                "points of kernel {index}"
            );
            assert_eq!(
                count(&document, "polyline", "stroke", &color),
                4,
                "lines of kernel {index}"
            );
        }
        assert_eq!(
            count(&document, "polyline", "stroke", &svg_color(REFERENCE_COLOR)),
            4,
            "ideal lines"
        );
    }

    #[test]
    fn the_missed_case_is_drawn_where_it_landed() {
        // graph with 30 ms kernels got 20 % at a 10 % target: its point sits
        // above the burst panel's 9.75 %, by the share of the axis that
        // 10.25 points take.
        let svg = known().plot_svg().expect("plot");
        let document = roxmltree::Document::parse(&svg).expect("well-formed SVG");
        let color = svg_color(SERIES_COLORS[1]);
        let mut points: Vec<(i32, i32)> = document
            .descendants()
            .filter(|node| node.has_tag_name("circle") && node.attribute("fill") == Some(&color))
            .filter_map(|node| {
                Some((
                    node.attribute("cx")?.parse().ok()?,
                    node.attribute("cy")?.parse().ok()?,
                ))
            })
            .collect();
        // The panels stand side by side: burst's three points come first.
        points.sort_unstable();
        let (burst, graph) = points.split_at(3);
        assert_eq!(
            (burst[1].1, burst[2].1),
            (graph[1].1, graph[2].1),
            "{points:?}"
        );
        let raised = f64::from(burst[0].1 - graph[0].1) / f64::from(burst[0].1 - burst[1].1);
        assert!((raised - 10.25 / 40.0).abs() < 0.02, "{raised} {points:?}");
    }

    #[test]
    fn empty_results_are_refused() {
        let mut results = known();
        results.cases.clear();
        assert!(matches!(results.plot_svg(), Err(PlotError::NoData(_))));
    }

    #[test]
    fn blocking_cases_are_set_beside_their_ordinary_twins_and_counted_when_further() {
        let mut results = known();
        results.cases = vec![
            case(30, "burst", "k1ms", 29.9),
            case(30, &blocking_pattern("burst"), "k1ms", 29.8),
            case(30, "sync", "k20us", 29.9),
            case(30, &blocking_pattern("sync"), "k20us", 28.0),
            case(30, "graph", "k1ms", 30.0),
        ];
        let table = results.blocking_table();
        assert!(table.contains("| 30 % | burst | k1ms | 29.90 % | 29.80 % | -0.10 | -0.20 |"));
        assert!(table.contains("| 30 % | sync | k20us | 29.90 % | 28.00 % | -0.10 | -2.00 |"));
        assert!(!table.contains("| graph |"), "no twin, no row");
        assert!(table.contains("1 of 2 cases with blocking launches further"));
        // The grid shows a blocking pattern as a panel of its own.
        assert!(results.patterns().contains(&"sync (blocking)"));
    }
}
