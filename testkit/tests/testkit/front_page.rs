//! The README, the project's front page, as the brief keeps it: at most
//! 400 lines, and the number of attacks it says the test command runs read
//! from the threat model's tables, where each attack is a row with its
//! test, not written by hand.

use std::path::PathBuf;

fn repo_file(path: &str) -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|error| panic!("{path}: {error}"))
}

/// The attack rows of `docs/threat-model.md`'s "Attacks tested": every
/// table row under that heading but the header, the rule and the rows of
/// what must keep working.
fn attack_rows(threat_model: &str) -> usize {
    let section = threat_model
        .split_once("\n## Attacks tested")
        .map(|(_, rest)| rest.split("\n## ").next().unwrap_or(rest))
        .expect("docs/threat-model.md has an \"Attacks tested\" section");
    section
        .lines()
        .filter(|line| line.starts_with("| "))
        .filter(|line| !line.starts_with("| attack |"))
        .filter(|line| !line.starts_with("| (what must keep working)"))
        .count()
}

#[test]
fn the_readme_counts_the_attacks_the_threat_model_lists() {
    let rows = attack_rows(&repo_file("docs/threat-model.md"));
    let readme = repo_file("README.md");
    let said = readme
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .find(|pair| pair[1] == "attacks" && pair[0].parse::<usize>().is_ok())
        .map(|pair| pair[0].parse::<usize>().expect("a number"))
        .expect("the README says how many attacks the test command runs");
    assert_eq!(
        said, rows,
        "the README says {said} attacks; docs/threat-model.md lists {rows}"
    );
}

#[test]
fn the_readme_is_a_front_page_of_at_most_400_lines() {
    let lines = repo_file("README.md").lines().count();
    assert!(lines <= 400, "README.md has {lines} lines");
}

#[test]
fn attack_rows_are_counted_from_every_table_of_the_section() {
    let text = "# T\n\n| a | b |\n\n## Attacks tested\n\n| attack | defence |\n|---|---|\n| one | x |\n| (what must keep working) | |\n\nmore\n\n| attack | defence |\n|---|---|\n| two | y |\n\n## Next\n\n| three | z |\n";
    assert_eq!(attack_rows(text), 2);
}
