//! No two modules of the scheduler crate import each other, directly or
//! through others: the layers point one way. The checker ([`graph`]) reads
//! any crate's `src` folder; its own tests below prove it finds circles of
//! every shape it claims to, and ignores what is no import.

mod graph;

use graph::{ModuleGraph, ROOT};
use std::path::{Path, PathBuf};

/// Writes `files` (path under `src`, text) into a fresh folder and reads
/// its module graph.
fn graph_of(files: &[(&str, &str)]) -> ModuleGraph {
    let src = vgpu_testkit::unique_temp_dir("module-graph").join("src");
    for (path, text) in files {
        let file = src.join(path);
        if let Some(folder) = file.parent() {
            std::fs::create_dir_all(folder).expect("create the module folder");
        }
        std::fs::write(&file, text).expect("write the module");
    }
    ModuleGraph::read(&src).expect("read the module graph")
}

fn circle_names(graph: &ModuleGraph) -> Vec<Vec<String>> {
    graph.circles().into_iter().map(|c| c.modules).collect()
}

#[test]
fn two_modules_importing_each_other_are_a_circle() {
    let graph = graph_of(&[
        ("lib.rs", "mod a;\nmod b;\n"),
        ("a.rs", "use crate::b::B;\npub struct A;\n"),
        ("b.rs", "use crate::a::A;\npub struct B;\n"),
    ]);
    let circles = graph.circles();
    assert_eq!(circle_names(&graph), vec![vec!["a", "b"]]);
    let report = circles[0].to_string();
    assert!(report.starts_with("a -> b -> a"), "{report}");
    assert_eq!(circles[0].group, vec!["a", "b"]);
    assert!(report.contains("a.rs:1 names crate::b::B"), "{report}");
    assert!(report.contains("b.rs:1 names crate::a::A"), "{report}");
}

#[test]
fn a_circle_through_use_trees_super_and_paths_in_code_is_found() {
    let graph = graph_of(&[
        ("lib.rs", "mod layer;\n"),
        ("layer/mod.rs", "mod x;\nmod y;\nmod z;\n"),
        // Braces expanded: x names y.
        ("layer/x.rs", "use super::{y::{self, Y}};\n"),
        // A path in code, not in a `use`: y names z.
        (
            "layer/y.rs",
            "pub struct Y;\nfn f() { crate::layer::z::g(); }\n",
        ),
        // A module brought in by `use` under another name, then a path
        // through it: z names x.
        (
            "layer/z.rs",
            "use crate::layer as tier;\nfn g() { tier::x::h(); }\n",
        ),
    ]);
    assert_eq!(
        circle_names(&graph),
        vec![vec!["layer::x", "layer::y", "layer::z"]]
    );
}

#[test]
fn a_parent_reexporting_a_child_that_imports_it_is_a_circle() {
    let graph = graph_of(&[
        ("lib.rs", "mod cache;\n"),
        (
            "cache/mod.rs",
            "mod pods;\npub use pods::Record;\npub struct State;\n",
        ),
        ("cache/pods.rs", "use super::State;\npub struct Record;\n"),
    ]);
    assert_eq!(circle_names(&graph), vec![vec!["cache", "cache::pods"]]);
}

#[test]
fn declarations_sibling_imports_tests_comments_and_strings_are_no_circle() {
    let graph = graph_of(&[
        ("lib.rs", "pub mod cache;\npub mod placement;\n"),
        // The folder's table of contents: declarations only.
        ("cache/mod.rs", "pub mod pods;\npub mod state;\n"),
        (
            "cache/state.rs",
            "use super::pods::Record;\npub struct State(Record);\n\
             #[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::cache::pods;\n}\n",
        ),
        (
            "cache/pods.rs",
            "//! Read by [`crate::placement::fit`]; see `use crate::placement`.\n\
             /* use crate::placement::fit; */\n\
             pub struct Record;\n\
             const WORDS: &str = \"use crate::placement::fit; crate::placement::fit::go()\";\n\
             const RAW: &str = r#\"crate::placement::fit\"#;\n\
             fn f<'a>(x: &'a str) -> char { let _ = x; 'c' }\n\
             pub(in crate::cache) fn g() {}\n",
        ),
        ("placement/mod.rs", "pub mod fit;\n"),
        (
            "placement/fit.rs",
            "use crate::cache::{pods::Record, state::State};\nfn go(_: Record, _: State) {}\n",
        ),
    ]);
    assert_eq!(circle_names(&graph), Vec::<Vec<String>>::new());
    assert_eq!(
        graph.imports_of("placement::fit"),
        vec!["cache::pods", "cache::state"]
    );
    assert_eq!(graph.imports_of("cache::pods"), Vec::<&str>::new());
    assert_eq!(graph.imports_of("cache::state"), vec!["cache::pods"]);
}

#[test]
fn binaries_beside_the_library_are_other_crates() {
    let graph = graph_of(&[
        ("lib.rs", "pub mod a;\n"),
        ("a.rs", "pub fn run() {}\n"),
        (
            "main.rs",
            "fn main() { crate::helper(); a::run(); }\nfn helper() {}\n",
        ),
        ("bin/tool.rs", "fn main() {}\n"),
    ]);
    assert_eq!(graph.modules().collect::<Vec<_>>(), vec!["a", ROOT]);
}

fn scheduler_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn the_scheduler_modules_import_each_other_in_no_circle() {
    let graph = ModuleGraph::read(&scheduler_src()).expect("read the scheduler's modules");
    assert!(
        graph.modules().count() > 20,
        "the scheduler's modules were not found"
    );
    let circles: Vec<String> = graph.circles().iter().map(ToString::to_string).collect();
    assert!(
        circles.is_empty(),
        "modules of the scheduler import each other:\n{}",
        circles.join("\n")
    );
}
