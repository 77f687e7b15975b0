//! The shim's cost against the driver alone: per call (allocation, launch)
//! and at start-up (the first `cuInit`).

use crate::plot::{PlotError, BAR_COLOR, FONT, REFERENCE_COLOR};
use crate::RunInfo;
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::{Deserialize, Serialize};

/// A run of `vgpu-bench`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OverheadResults {
    pub run: RunInfo,
    /// Runs per figure (each figure is their median).
    pub repeats: usize,
    /// Allocation and free pairs per run.
    pub alloc_iterations: u64,
    /// Launches per run of the refused launch (a tenth of it for real ones).
    pub launch_iterations: u64,
    /// Per-call costs, in the table's order.
    pub calls: Vec<CallCost>,
    /// Start-up costs, in the table's order.
    pub start_ups: Vec<StartUpCost>,
}

/// One call measured against its baseline: the driver alone, or for the
/// swap row the same call served from device memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallCost {
    /// The table's row label.
    pub measurement: String,
    /// The plot's bar label.
    pub short: String,
    /// The baseline: the table's "driver alone" column, in nanoseconds.
    pub baseline_ns: f64,
    /// The table's "with shim" column, in nanoseconds.
    pub measured_ns: f64,
    /// Decimals the table prints.
    pub decimals: usize,
}

/// The table's header.
pub const TABLE_HEADER: &str =
    "| measurement | driver alone | with shim | added | ratio |\n|---|---:|---:|---:|---:|\n";

impl CallCost {
    /// Measured over baseline.
    pub fn ratio(&self) -> f64 {
        self.measured_ns / self.baseline_ns
    }

    /// The table's row, with its line end.
    pub fn table_row(&self) -> String {
        let decimals = self.decimals;
        format!(
            "| {} | {:.decimals$} ns | {:.decimals$} ns | {:.decimals$} ns | {:.2}x |\n",
            self.measurement,
            self.baseline_ns,
            self.measured_ns,
            self.measured_ns - self.baseline_ns,
            self.ratio()
        )
    }
}

/// The median and the 99th percentile of a set of times, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p99: f64,
}

/// The first `cuInit` of processes starting at once, with the driver alone
/// and with the shim, and the shim's own set-up within it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartUpCost {
    pub processes: usize,
    /// Whether the region existed before they started (as the device plugin
    /// prepares it) or the processes created it.
    pub region_exists: bool,
    pub driver_ms: Percentiles,
    pub shim_ms: Percentiles,
    /// The shim's own set-up, wall-clock time.
    pub shim_own_wall_ms: Percentiles,
    /// The shim's own set-up, CPU time.
    pub shim_own_cpu_ms: Percentiles,
}

impl StartUpCost {
    /// "N processes starting at once, region ...", as the table reads.
    pub fn label(&self) -> String {
        let (plural, region) = self.wording();
        format!(
            "{} process{plural} starting at once, region {region}",
            self.processes
        )
    }

    /// The plural ending of "process" and what the region was.
    fn wording(&self) -> (&'static str, &'static str) {
        (
            if self.processes == 1 { "" } else { "es" },
            if self.region_exists {
                "already there"
            } else {
                "created by them"
            },
        )
    }

    /// The table's two rows (first cuInit; the shim's own set-up in it),
    /// with their line ends.
    pub fn table_rows(&self) -> String {
        let label = self.label();
        let (driver, shim) = (self.driver_ms, self.shim_ms);
        let (wall, cpu) = (self.shim_own_wall_ms, self.shim_own_cpu_ms);
        format!(
            "| first cuInit, {label}: p50 / p99 | {:.3} / {:.3} ms | {:.3} / {:.3} ms | {:.3} / {:.3} ms | |\n\
             | shim's own set-up in it, {label}: p50 / p99 wall (cpu) | | {:.3} / {:.3} ms ({:.3} / {:.3} ms) | | |\n",
            driver.p50,
            driver.p99,
            shim.p50,
            shim.p99,
            shim.p50 - driver.p50,
            shim.p99 - driver.p99,
            wall.p50,
            wall.p99,
            cpu.p50,
            cpu.p99
        )
    }

    fn short_label(&self) -> String {
        let (plural, region) = self.wording();
        format!(
            "first cuInit, {} process{plural}, region {region}",
            self.processes
        )
    }
}

/// One bar of the plot: the ratio and what to write beside it.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    pub label: String,
    pub ratio: f64,
    pub note: String,
}

/// Title of the per-call panel.
pub const CALLS_TITLE: &str = "Per call: time with the shim ÷ time of the driver alone";
/// Title of the start-up panel.
pub const START_UP_TITLE: &str = "Start-up: first cuInit with the shim ÷ the driver alone";
/// The reference line's legend.
pub const REFERENCE_LABEL: &str = "1× = the driver alone";
/// The value axis' description.
pub const RATIO_AXIS: &str = "with the shim ÷ driver alone (×)";

impl OverheadResults {
    /// The Markdown table `vgpu-bench` prints.
    pub fn table(&self) -> String {
        let mut out = String::from(TABLE_HEADER);
        for call in &self.calls {
            out.push_str(&call.table_row());
        }
        for start in &self.start_ups {
            out.push_str(&start.table_rows());
        }
        out
    }

    /// A bar per call.
    pub fn call_bars(&self) -> Vec<Bar> {
        self.calls
            .iter()
            .map(|call| {
                let decimals = call.decimals;
                Bar {
                    label: call.short.clone(),
                    ratio: call.ratio(),
                    note: format!(
                        "{:.2}×  ({:.decimals$} → {:.decimals$} ns)",
                        call.ratio(),
                        call.baseline_ns,
                        call.measured_ns
                    ),
                }
            })
            .collect()
    }

    /// Two bars per start-up: its p50 and its p99.
    pub fn start_up_bars(&self) -> Vec<Bar> {
        let mut bars = Vec::new();
        for start in &self.start_ups {
            for (name, driver, shim) in [
                ("p50", start.driver_ms.p50, start.shim_ms.p50),
                ("p99", start.driver_ms.p99, start.shim_ms.p99),
            ] {
                bars.push(Bar {
                    label: format!("{}: {name}", start.short_label()),
                    ratio: shim / driver,
                    note: format!("{:.2}×  ({driver:.3} → {shim:.3} ms)", shim / driver),
                });
            }
        }
        bars
    }

    /// The table as bars against the driver alone: a panel of per-call
    /// ratios and one of start-up ratios, as SVG.
    pub fn plot_svg(&self) -> Result<String, PlotError> {
        let panels: Vec<(&str, Vec<Bar>)> = [
            (CALLS_TITLE, self.call_bars()),
            (START_UP_TITLE, self.start_up_bars()),
        ]
        .into_iter()
        .filter(|(_, bars)| !bars.is_empty())
        .collect();
        if panels.is_empty() {
            return Err(PlotError::NoData("measurements"));
        }
        let (width, title_height, bar_height, panel_frame) = (1100u32, 60u32, 34u32, 120u32);
        let panel_heights: Vec<u32> = panels
            .iter()
            .map(|(_, bars)| bars.len() as u32 * bar_height + panel_frame)
            .collect();
        let height = title_height + panel_heights.iter().sum::<u32>();
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
            root.fill(&WHITE)?;
            let (title, mut rest) = root.split_vertically(title_height);
            title.titled("What the shim adds, against the driver alone", (FONT, 22))?;
            title.draw(&Text::new(
                format!(
                    "simulated GPU; medians of {} runs; bars start at 0, the line marks the driver alone",
                    self.repeats
                ),
                (10, 38),
                (FONT, 15),
            ))?;
            for ((caption, bars), panel_height) in panels.iter().zip(&panel_heights) {
                let (panel, below) = rest.split_vertically(*panel_height);
                rest = below;
                draw_bars(&panel, caption, bars)?;
            }
            root.present()?;
        }
        Ok(svg)
    }
}

/// Horizontal bars of `bars`' ratios, first bar on top, with a line at 1×.
fn draw_bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    caption: &str,
    bars: &[Bar],
) -> Result<(), PlotError>
where
    DB::ErrorType: 'static,
{
    let count = bars.len();
    let widest = bars.iter().map(|bar| bar.ratio).fold(1.0f64, f64::max);
    // Room right of the longest bar for its note.
    let right_edge = widest * 1.45 + 0.2;
    // Rows count from the bottom; the first bar goes on top.
    let row_of = |index: usize| count - 1 - index;
    let labels: Vec<String> = bars.iter().map(|bar| bar.label.clone()).collect();
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 18))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(400)
        .build_cartesian_2d(0f64..right_edge, (0..count - 1).into_segmented())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .light_line_style(WHITE.mix(0.0))
        .y_labels(count)
        .y_label_formatter(&|value| match value {
            SegmentValue::CenterOf(row) | SegmentValue::Exact(row) => labels
                .get(count - 1 - row.min(&(count - 1)))
                .cloned()
                .unwrap_or_default(),
            SegmentValue::Last => String::new(),
        })
        .x_desc(RATIO_AXIS)
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 14))
        .draw()?;
    chart.draw_series(bars.iter().enumerate().map(|(index, bar)| {
        let row = row_of(index);
        let top = if row + 1 < count {
            SegmentValue::Exact(row + 1)
        } else {
            SegmentValue::Last
        };
        let mut rectangle = Rectangle::new(
            [(0.0, SegmentValue::Exact(row)), (bar.ratio, top)],
            BAR_COLOR.filled(),
        );
        rectangle.set_margin(5, 5, 0, 0);
        rectangle
    }))?;
    let note_style =
        TextStyle::from((FONT, 13).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    chart.draw_series(bars.iter().enumerate().map(|(index, bar)| {
        EmptyElement::at((bar.ratio, SegmentValue::CenterOf(row_of(index))))
            + Text::new(bar.note.clone(), (6, 0), note_style.clone())
    }))?;
    chart
        .draw_series(LineSeries::new(
            [(1.0, SegmentValue::Exact(0)), (1.0, SegmentValue::Last)],
            REFERENCE_COLOR.stroke_width(2),
        ))?
        .label(REFERENCE_LABEL)
        .legend(|(x, y)| {
            PathElement::new([(x, y - 6), (x, y + 6)], REFERENCE_COLOR.stroke_width(2))
        });
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font((FONT, 13))
        .background_style(WHITE.mix(0.9))
        .border_style(REFERENCE_COLOR)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::svg_color;
    use crate::saved::utc_timestamp;

    fn call(short: &str, baseline_ns: f64, measured_ns: f64) -> CallCost {
        CallCost {
            measurement: format!("{short} (table)"),
            short: short.into(),
            baseline_ns,
            measured_ns,
            decimals: 1,
        }
    }

    fn known() -> OverheadResults {
        OverheadResults {
            run: RunInfo {
                command: "vgpu-bench".into(),
                finished_utc: utc_timestamp(0),
                cpus: 2,
            },
            repeats: 3,
            alloc_iterations: 10,
            launch_iterations: 10,
            calls: vec![
                call("alloc", 100.0, 150.0),
                call("launch", 20.0, 20.0),
                call("hook", 10.0, 40.0),
            ],
            start_ups: vec![StartUpCost {
                processes: 64,
                region_exists: true,
                driver_ms: Percentiles {
                    p50: 0.25,
                    p99: 10.0,
                },
                shim_ms: Percentiles {
                    p50: 0.5,
                    p99: 12.5,
                },
                shim_own_wall_ms: Percentiles {
                    p50: 0.08,
                    p99: 2.5,
                },
                shim_own_cpu_ms: Percentiles {
                    p50: 0.07,
                    p99: 0.125,
                },
            }],
        }
    }

    fn document_texts(document: &roxmltree::Document) -> Vec<String> {
        document
            .descendants()
            .filter(|node| node.has_tag_name("text"))
            .map(|node| node.text().unwrap_or_default().trim().to_string())
            .collect()
    }

    /// The bars' rectangles: (x, y, width, height).
    fn bar_rectangles(document: &roxmltree::Document) -> Vec<(i32, i32, i32, i32)> {
        let color = svg_color(BAR_COLOR);
        document
            .descendants()
            .filter(|node| node.has_tag_name("rect") && node.attribute("fill") == Some(&color))
            .filter_map(|node| {
                let number = |name| node.attribute(name)?.parse().ok();
                Some((
                    number("x")?,
                    number("y")?,
                    number("width")?,
                    number("height")?,
                ))
            })
            .collect()
    }

    #[test]
    fn table_rows_add_and_divide() {
        let table = known().table();
        assert!(
            table.contains("| hook (table) | 10.0 ns | 40.0 ns | 30.0 ns | 4.00x |"),
            "{table}"
        );
        assert!(
            table.contains("| first cuInit, 64 processes starting at once, region already there: p50 / p99 | 0.250 / 10.000 ms | 0.500 / 12.500 ms | 0.250 / 2.500 ms | |"),
            "{table}"
        );
        assert!(
            table.contains("| shim's own set-up in it, 64 processes starting at once, region already there: p50 / p99 wall (cpu) | | 0.080 / 2.500 ms (0.070 / 0.125 ms) | | |"),
            "{table}"
        );
    }

    #[test]
    fn plot_has_a_bar_per_call_and_two_per_start_up_labelled_and_in_proportion() {
        let svg = known().plot_svg().expect("plot");
        let document = roxmltree::Document::parse(&svg).expect("well-formed SVG");
        assert!(document.root_element().has_tag_name("svg"));
        let texts = document_texts(&document);
        for wanted in [
            CALLS_TITLE,
            START_UP_TITLE,
            "alloc",
            "launch",
            "hook",
            "first cuInit, 64 processes, region already there: p50",
            "first cuInit, 64 processes, region already there: p99",
            "1.50×  (100.0 → 150.0 ns)",
            "4.00×  (10.0 → 40.0 ns)",
            "2.00×  (0.250 → 0.500 ms)",
            "1.25×  (10.000 → 12.500 ms)",
        ] {
            assert_eq!(
                texts.iter().filter(|t| *t == wanted).count(),
                1,
                "{wanted}: {texts:?}"
            );
        }
        for shared in [RATIO_AXIS, REFERENCE_LABEL] {
            assert_eq!(
                texts.iter().filter(|t| *t == shared).count(),
                2,
                "{shared}: {texts:?}"
            );
        }
        let bars = bar_rectangles(&document);
        assert_eq!(bars.len(), 5, "{bars:?}");
        // The per-call panel: alloc on top, then launch, then hook; all start
        // at the same x, and their widths go as 1.5 : 1 : 4.
        let calls = &bars[..3];
        assert!(
            calls.windows(2).all(|pair| pair[0].1 < pair[1].1),
            "{calls:?}"
        );
        assert!(calls.iter().all(|bar| bar.0 == calls[0].0), "{calls:?}");
        let unit = f64::from(calls[1].2);
        for (bar, ratio) in calls.iter().zip([1.5, 1.0, 4.0]) {
            assert!((f64::from(bar.2) / unit - ratio).abs() < 0.05, "{calls:?}");
        }
        // The reference line of each panel is one polyline.
        assert_eq!(
            document
                .descendants()
                .filter(|node| node.has_tag_name("polyline")
                    && node.attribute("stroke") == Some(&svg_color(REFERENCE_COLOR)))
                .count(),
            4,
            "two reference lines and their two legend samples"
        );
    }

    #[test]
    fn a_table_without_start_ups_plots_one_panel() {
        let mut results = known();
        results.start_ups.clear();
        let svg = results.plot_svg().expect("plot");
        let document = roxmltree::Document::parse(&svg).expect("well-formed SVG");
        assert_eq!(bar_rectangles(&document).len(), 3);
        assert!(!document_texts(&document)
            .iter()
            .any(|text| text == START_UP_TITLE));
        results.calls.clear();
        assert!(matches!(results.plot_svg(), Err(PlotError::NoData(_))));
    }

    #[test]
    fn a_single_bar_plots() {
        let mut results = known();
        results.start_ups.clear();
        results.calls.truncate(1);
        let svg = results.plot_svg().expect("plot");
        let document = roxmltree::Document::parse(&svg).expect("well-formed SVG");
        assert_eq!(bar_rectangles(&document).len(), 1);
    }
}
