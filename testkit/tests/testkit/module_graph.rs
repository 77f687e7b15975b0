//! No two modules of any crate of the workspace import each other,
//! directly or through others: each crate's layers point one way. The
//! checker ([`vgpu_testkit::module_graph`]) reads a crate's `src` folder;
//! the first tests prove it finds circles of every shape it claims to and
//! ignores what is no import, the last runs it over every member of the
//! workspace.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use vgpu_testkit::module_graph::{Circle, ModuleGraph, ROOT};

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

/// Circles a crate may keep: (crate folder, the modules of one group of
/// modules that reach each other). A crate's circle passes when all its
/// modules are in one such group, so a circle that is removed never fails
/// the test, and a new one does.
const ALLOWED: &[(&str, &[&str])] = &[
    // Inherent to interposing `dlsym`: the shim's `dlsym` answers with the
    // driver's hooks, and the driver module resolves the real functions
    // through the real `dlsym`.
    ("shim", &["dlsym", "driver"]),
    // Until their crates are split (another change is at it): the shim's
    // hooks, limiter, driver and context accounting, which still reach
    // each other (context_size -> driver -> hooks -> hooks::context ->
    // enforcer -> context_size); and the bench's library root and its
    // result modules (`RunInfo`).
    (
        "shim",
        &[
            "context_size",
            "dlsym",
            "driver",
            "enforcer",
            "hooks",
            "hooks::context",
            "hooks::info",
            "hooks::launch",
            "hooks::memory",
            "hooks::module",
            "hooks::nvml",
            "hooks::procaddr",
            "limiter",
            "limiter::samples",
        ],
    ),
    ("bench", &[ROOT, "accuracy", "overhead", "saved"]),
];

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit lies in the workspace")
        .to_path_buf()
}

/// The folders of the workspace's members, as its `Cargo.toml` lists them.
fn workspace_members(root: &Path) -> Vec<String> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("read Cargo.toml");
    let start = manifest
        .find("members = [")
        .expect("the workspace lists its members");
    let list = &manifest[start + "members = [".len()..];
    let list = &list[..list.find(']').expect("the member list ends")];
    list.split(',')
        .map(|member| member.trim().trim_matches('"').to_string())
        .filter(|member| !member.is_empty())
        .collect()
}

fn allowed(member: &str, circle: &Circle) -> bool {
    let group: BTreeSet<&str> = circle.group.iter().map(String::as_str).collect();
    ALLOWED.iter().any(|(crate_folder, modules)| {
        *crate_folder == member && group.iter().all(|module| modules.contains(module))
    })
}

#[test]
fn the_checker_reads_every_member_of_the_workspace() {
    let members = workspace_members(&workspace_root());
    for expected in [
        "scheduler",
        "plugin",
        "dra",
        "node-agent",
        "monitor",
        "testkit",
    ] {
        assert!(
            members.iter().any(|member| member == expected),
            "{expected} not among {members:?}"
        );
    }
    let scheduler = ModuleGraph::read(&workspace_root().join("scheduler/src"))
        .expect("read the scheduler's modules");
    assert!(
        scheduler.modules().count() > 20,
        "the scheduler's modules were not found"
    );
}

#[test]
fn no_crate_of_the_workspace_has_modules_importing_each_other() {
    let root = workspace_root();
    let mut found = Vec::new();
    for member in workspace_members(&root) {
        let graph = ModuleGraph::read(&root.join(&member).join("src"))
            .unwrap_or_else(|error| panic!("read {member}'s modules: {error}"));
        assert!(
            graph.modules().any(|module| module == ROOT),
            "{member} has no crate root"
        );
        for circle in graph.circles() {
            if !allowed(&member, &circle) {
                found.push(format!("{member}: {circle}"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "modules import each other:\n{}",
        found.join("\n")
    );
}

#[test]
fn a_circle_is_allowed_only_inside_a_group_listed_for_its_crate() {
    let circle = |modules: &[&str]| Circle {
        modules: modules.iter().map(|m| m.to_string()).collect(),
        steps: Vec::new(),
        group: modules.iter().map(|m| m.to_string()).collect(),
    };
    assert!(allowed("shim", &circle(&["dlsym", "driver"])));
    assert!(!allowed("shim", &circle(&["dlsym", "driver", "config"])));
    assert!(!allowed("plugin", &circle(&["dlsym", "driver"])));
    assert!(allowed("bench", &circle(&[ROOT, "accuracy"])));
    assert!(!allowed("simgpu", &circle(&["driver", "state"])));
}
