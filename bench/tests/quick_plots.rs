//! The quick runs of `vgpu-accuracy` and `vgpu-bench` save their results and
//! draw them, and `vgpu-plot` draws the same SVG again from the saved file.
//!
//! They run the shim on the simulated GPU: release builds of the workspace
//! first, as for every test that runs the shim (`scripts/test`).

use std::path::{Path, PathBuf};
use std::process::Command;
use vgpu_bench::accuracy::{panel_caption, series_label, ACHIEVED_AXIS, IDEAL_LABEL, TARGET_AXIS};
use vgpu_bench::overhead::{CALLS_TITLE, RATIO_AXIS, REFERENCE_LABEL, START_UP_TITLE};
use vgpu_bench::plot::{svg_color, BAR_COLOR, SERIES_COLORS};
use vgpu_bench::SavedResults;

/// A directory of this test's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("vgpu-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create scratch directory");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run(program: &str, args: &[&Path]) -> String {
    let output = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|error| panic!("cannot run {program}: {error}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{program} failed: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// Runs `program --quick --save DIR/name.json --plot DIR/name.svg`, then
/// `vgpu-plot` on the saved file; checks both drew the same SVG and returns
/// the saved results, the SVG and what the benchmark printed.
fn quick_run(program: &str, scratch: &Scratch, name: &str) -> (SavedResults, String, String) {
    let (results, plot, again) = (
        scratch.0.join(format!("{name}.json")),
        scratch.0.join(format!("{name}.svg")),
        scratch.0.join(format!("{name}-again.svg")),
    );
    let printed = run(
        program,
        &[
            Path::new("--quick"),
            Path::new("--save"),
            &results,
            Path::new("--plot"),
            &plot,
        ],
    );
    let saved = SavedResults::load(&results).expect("saved results");
    let svg = std::fs::read_to_string(&plot).expect("plot written");
    run(env!("CARGO_BIN_EXE_vgpu-plot"), &[&results, &again]);
    assert_eq!(
        std::fs::read_to_string(&again).expect("plot drawn again"),
        svg,
        "vgpu-plot drew {name} differently from the saved results"
    );
    let table = run(
        env!("CARGO_BIN_EXE_vgpu-plot"),
        &[Path::new("--table"), &results],
    );
    assert!(table.contains(&saved.tables()), "{table}");
    assert!(printed.contains(&saved.tables()), "{printed}");
    (saved, svg, printed)
}

fn texts(document: &roxmltree::Document) -> Vec<String> {
    document
        .descendants()
        .filter(|node| node.has_tag_name("text"))
        .map(|node| node.text().unwrap_or_default().trim().to_string())
        .collect()
}

fn count(document: &roxmltree::Document, tag: &str, fill: &str) -> usize {
    document
        .descendants()
        .filter(|node| node.has_tag_name(tag) && node.attribute("fill") == Some(fill))
        .count()
}

#[test]
fn quick_accuracy_sweep_plots_achieved_against_target() {
    let scratch = Scratch::new("accuracy-plot");
    let (saved, svg, _) = quick_run(env!("CARGO_BIN_EXE_vgpu-accuracy"), &scratch, "accuracy");
    let SavedResults::Accuracy(results) = saved else {
        panic!("vgpu-accuracy saved {saved:?}");
    };
    assert_eq!(results.cases.len(), 4, "{results:?}");
    assert!(
        results
            .run
            .command
            .starts_with("vgpu-accuracy --quick --save"),
        "{:?}",
        results.run
    );
    let document = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    assert!(document.root_element().has_tag_name("svg"));
    let texts = texts(&document);
    let patterns = results.patterns();
    assert_eq!(patterns, ["burst", "graph"]);
    for pattern in &patterns {
        assert!(
            texts.contains(&panel_caption(pattern)),
            "{pattern}: {texts:?}"
        );
    }
    for label in [
        TARGET_AXIS,
        ACHIEVED_AXIS,
        IDEAL_LABEL,
        &series_label("k1ms"),
    ] {
        assert_eq!(
            texts.iter().filter(|text| *text == label).count(),
            patterns.len(),
            "{label}: {texts:?}"
        );
    }
    // One point per case, all of the one kernel length's colour.
    assert_eq!(
        count(&document, "circle", &svg_color(SERIES_COLORS[0])),
        results.cases.len()
    );
}

#[test]
fn quick_bench_plots_bars_against_the_driver_alone() {
    let scratch = Scratch::new("overhead-plot");
    let (saved, svg, printed) = quick_run(env!("CARGO_BIN_EXE_vgpu-bench"), &scratch, "overhead");
    let SavedResults::Overhead(results) = saved else {
        panic!("vgpu-bench saved {saved:?}");
    };
    assert_eq!(
        (results.calls.len(), results.start_ups.len()),
        (7, 3),
        "{printed}"
    );
    let document = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    assert!(document.root_element().has_tag_name("svg"));
    let texts = texts(&document);
    for label in [CALLS_TITLE, START_UP_TITLE] {
        assert!(texts.iter().any(|text| text == label), "{label}: {texts:?}");
    }
    for label in [RATIO_AXIS, REFERENCE_LABEL] {
        assert_eq!(
            texts.iter().filter(|text| *text == label).count(),
            2,
            "{label}: {texts:?}"
        );
    }
    let bars = results
        .call_bars()
        .into_iter()
        .chain(results.start_up_bars());
    let mut drawn = 0;
    for bar in bars {
        drawn += 1;
        assert!(texts.contains(&bar.label), "{}: {texts:?}", bar.label);
        assert!(texts.contains(&bar.note), "{}: {texts:?}", bar.note);
    }
    assert_eq!(drawn, 7 + 2 * 3);
    assert_eq!(count(&document, "rect", &svg_color(BAR_COLOR)), drawn);
}
