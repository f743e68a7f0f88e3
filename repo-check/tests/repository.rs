//! The repository checks themselves (see the crate's documentation): each failure lists every
//! offending file and line at once.

use gpushare_repo_check::*;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> Repo {
    Repo::open().unwrap_or_else(|e| panic!("{e}"))
}

fn fail_if_any(problems: Vec<String>, what: &str) {
    assert!(problems.is_empty(), "{what}:\n  {}", problems.join("\n  "));
}

#[test]
fn every_relative_link_and_anchor_in_markdown_resolves() {
    let repo = repo();
    let mut problems = Vec::new();
    let mut checked = 0;
    for (file, text) in repo.texts() {
        if file.extension().is_none_or(|e| e != "md") {
            continue;
        }
        for link in links(&text) {
            checked += 1;
            if let Some(why) = repo.check_link(file, &link.dest) {
                problems.push(format!("{}:{}: {why}", file.display(), link.line));
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} links found: is the repository all here?"
    );
    fail_if_any(problems, "broken links in Markdown");
}

#[test]
fn no_file_cites_a_document_outside_the_repository() {
    let repo = repo();
    let mut problems = Vec::new();
    for (file, text) in repo.texts() {
        for (line, why, found) in matches(&OUTSIDE_DOCUMENTS, &text) {
            problems.push(format!("{}:{line}: {found:?}: {why}", file.display()));
        }
        // `docs/<page>.md#<anchor>` cited from code, tests, scripts or docs must exist.
        for (at, citation) in doc_citations(&text) {
            if let Some(why) = repo.check_link(Path::new(""), &citation) {
                problems.push(format!("{}:{}: {why}", file.display(), line_of(&text, at)));
            }
        }
    }
    fail_if_any(
        problems,
        "citations of documents that are not in the repository",
    );
}

#[test]
fn no_development_history_in_the_product() {
    let repo = repo();
    let mut problems = Vec::new();
    for (file, text) in repo.texts() {
        for (line, why, found) in matches(&HISTORY, &text) {
            problems.push(format!("{}:{line}: {found:?}: {why}", file.display()));
        }
    }
    fail_if_any(
        problems,
        "development history in the product (say it in the commit message instead)",
    );
}

#[test]
fn the_readme_stays_short() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 250,
        "README.md has {lines} lines; keep it at most 250 and move the detail into docs/"
    );
}

/// The directory of the running test's profile (`target/<profile>`), where `cargo build
/// --workspace` put the programs.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let mut dir = exe.parent().expect("a directory").to_path_buf();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    dir
}

/// The workspace's programs (bin targets named `gpushare…`), from `cargo metadata`.
fn programs() -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(&cargo)
        .current_dir(root())
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cargo} metadata: {e}"));
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
    let mut bins: Vec<String> = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter(|t| {
            t["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "bin"))
        })
        .filter_map(|t| t["name"].as_str())
        .filter(|n| n.starts_with("gpushare"))
        .map(str::to_string)
        .collect();
    bins.sort();
    bins.dedup();
    assert!(
        bins.len() >= 5,
        "found only {bins:?} among the workspace's programs in cargo metadata's output"
    );
    bins
}

fn help(program: &Path, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .arg("--help")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    assert!(
        out.status.success(),
        "{} {} --help failed: {}",
        program.display(),
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn every_flag_of_every_program_is_documented() {
    let doc = std::fs::read_to_string(root().join("docs/configuration.md")).unwrap();
    let dir = target_dir();
    let mut problems = Vec::new();
    for name in programs() {
        let program = dir.join(&name);
        assert!(
            program.is_file(),
            "{} is missing: run `cargo build --workspace` first (scripts/test does)",
            program.display()
        );
        let top = help(&program, &[]);
        let mut texts = vec![(name.clone(), top.clone())];
        for sub in subcommands_in_help(&top) {
            texts.push((format!("{name} {sub}"), help(&program, &[&sub])));
        }
        for (command, text) in texts {
            for flag in flags_in_help(&text) {
                if !mentions(&doc, &format!("--{flag}")) {
                    problems.push(format!("{command} --{flag}"));
                }
            }
        }
    }
    fail_if_any(problems, "flags missing from docs/configuration.md");
}

#[test]
fn every_environment_variable_is_documented() {
    let repo = repo();
    let doc = std::fs::read_to_string(root().join("docs/configuration.md")).unwrap();
    let var = regex::Regex::new(r#""(GPUSHARE_[A-Z0-9_]+)""#).unwrap();
    let mut problems = Vec::new();
    for (file, text) in repo.texts() {
        if file.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        for c in var.captures_iter(&text) {
            if !mentions(&doc, &c[1]) {
                let at = line_of(&text, c.get(0).unwrap().start());
                problems.push(format!("{}:{at}: {}", file.display(), &c[1]));
            }
        }
    }
    fail_if_any(
        problems,
        "environment variables missing from docs/configuration.md",
    );
}
