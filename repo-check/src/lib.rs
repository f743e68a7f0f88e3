//! Checks of the repository itself, run as tests (`tests/repository.rs`): its Markdown links and
//! anchors resolve, its files cite only documents it holds, they carry no development history
//! (that belongs in commit messages), and every flag and environment variable of its programs is
//! documented in `docs/configuration.md`.
//!
//! Anchors are GitHub's: a heading's slug, or an explicit `<a id="…">` (or `name`).

use pulldown_cmark::{Event, Parser, Tag, TagEnd};
use regex::Regex;
use std::collections::{BTreeSet, HashSet};
use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::sync::LazyLock;

/// The repository's root directory.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate lives in the repository")
        .to_path_buf()
}

/// The repository's files, relative to `root`: those git tracks and those it would track (not
/// ignored), that exist.
pub fn files(root: &Path) -> Result<Vec<PathBuf>, String> {
    // Only the file list is read: trusting the checkout for that is safe whoever owns it (a
    // checkout owned by another user than the tests' is otherwise "dubious" to git).
    let mut trust = std::ffi::OsString::from("safe.directory=");
    trust.push(root);
    let out = Command::new("git")
        .arg("-c")
        .arg(trust)
        .arg("-C")
        .arg(root)
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .output()
        .map_err(|e| format!("cannot run git to list the repository's files: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`git ls-files` failed in {} (these checks need a git checkout): {}",
            root.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let mut files: Vec<PathBuf> = out
        .stdout
        .split(|&b| b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| PathBuf::from(String::from_utf8_lossy(p).into_owned()))
        .filter(|p| root.join(p).is_file())
        .collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// A file's text, or `None` for a binary file (NUL bytes, or not UTF-8).
pub fn text(path: &Path) -> Option<String> {
    let bytes = std::fs::read(path).ok()?;
    if bytes.contains(&0) {
        return None;
    }
    String::from_utf8(bytes).ok()
}

/// 1-based line of byte `offset` in `text`.
pub fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// GitHub's slug of a heading's text: lower case, letters, digits, `-` and `_` kept, spaces made
/// `-`, everything else dropped.
pub fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

static EXPLICIT_ANCHOR: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r#"<a\s+(?:id|name)\s*=\s*"([^"]+)""#).unwrap());
static HTML_LINK: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r#"(?:href|src)\s*=\s*"([^"]+)""#).unwrap());

/// The anchors a Markdown document defines: its headings' slugs (repeats numbered `-1`, `-2`, …,
/// as GitHub does) and its explicit `<a id>` / `<a name>` anchors.
pub fn anchors(markdown: &str) -> HashSet<String> {
    let mut found = HashSet::new();
    let mut heading: Option<String> = None;
    for event in Parser::new(markdown) {
        match event {
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::End(TagEnd::Heading(_)) => {
                if let Some(h) = heading.take() {
                    let base = slug(&h);
                    let mut s = base.clone();
                    let mut n = 0;
                    while !found.insert(s.clone()) {
                        n += 1;
                        s = format!("{base}-{n}");
                    }
                }
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::Html(h) | Event::InlineHtml(h) => {
                for c in EXPLICIT_ANCHOR.captures_iter(&h) {
                    found.insert(c[1].to_string());
                }
            }
            _ => {}
        }
    }
    found
}

/// A link in a Markdown document: where it points, and its line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub line: usize,
    pub dest: String,
}

/// Every link and image of a Markdown document (also `href`/`src` of inline HTML).
pub fn links(markdown: &str) -> Vec<Link> {
    let mut found = Vec::new();
    for (event, range) in Parser::new(markdown).into_offset_iter() {
        let line = line_of(markdown, range.start);
        match event {
            Event::Start(Tag::Link { dest_url, .. })
            | Event::Start(Tag::Image { dest_url, .. }) => found.push(Link {
                line,
                dest: dest_url.to_string(),
            }),
            Event::Html(h) | Event::InlineHtml(h) => {
                for c in HTML_LINK.captures_iter(&h) {
                    found.push(Link {
                        line,
                        dest: c[1].to_string(),
                    });
                }
            }
            _ => {}
        }
    }
    found
}

/// `base/rel` with `.` and `..` resolved lexically; `None` if it leaves the repository.
fn join(base: &Path, rel: &str) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in base.join(rel).components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// The repository's files, with a lookup of files and the directories that hold them.
pub struct Repo {
    pub root: PathBuf,
    pub files: Vec<PathBuf>,
    known: HashSet<PathBuf>,
}

impl Repo {
    pub fn open() -> Result<Repo, String> {
        let root = root();
        let files = files(&root)?;
        let mut known = HashSet::new();
        for f in &files {
            let mut p = f.clone();
            known.insert(p.clone());
            while p.pop() && !p.as_os_str().is_empty() {
                known.insert(p.clone());
            }
        }
        Ok(Repo { root, files, known })
    }

    /// Whether `path` (relative to the root) is one of the repository's files or directories.
    pub fn holds(&self, path: &Path) -> bool {
        path.as_os_str().is_empty() || self.known.contains(path)
    }

    /// The anchors of the Markdown file `path`, if it is one of the repository's.
    pub fn anchors_of(&self, path: &Path) -> Option<HashSet<String>> {
        if !self.holds(path) {
            return None;
        }
        text(&self.root.join(path)).map(|t| anchors(&t))
    }

    /// Why `dest`, linked from the file `from`, does not resolve; `None` if it does.
    /// External links (with a scheme) are not followed.
    pub fn check_link(&self, from: &Path, dest: &str) -> Option<String> {
        if dest.contains("://") || dest.starts_with("mailto:") {
            return None;
        }
        let (path, anchor) = match dest.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (dest, None),
        };
        let target = if path.is_empty() {
            from.to_path_buf()
        } else {
            match join(from.parent().unwrap_or(Path::new("")), path) {
                Some(t) => t,
                None => return Some(format!("{dest}: points outside the repository")),
            }
        };
        if !self.holds(&target) {
            return Some(format!(
                "{dest}: {} is not in the repository",
                target.display()
            ));
        }
        let anchor = anchor?;
        match self.anchors_of(&target) {
            Some(a) if a.contains(anchor) => None,
            Some(a) => {
                let mut known: Vec<&String> = a.iter().collect();
                known.sort();
                Some(format!(
                    "{dest}: {} has no anchor #{anchor} (it has: {})",
                    target.display(),
                    known
                        .iter()
                        .map(|s| format!("#{s}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                ))
            }
            None => Some(format!(
                "{dest}: #{anchor} in {}, which is not a Markdown document",
                target.display()
            )),
        }
    }

    /// The repository's text files with their contents.
    pub fn texts(&self) -> impl Iterator<Item = (&PathBuf, String)> {
        self.files
            .iter()
            .filter_map(|f| text(&self.root.join(f)).map(|t| (f, t)))
    }
}

/// Citations of the repository's documentation in any text (`docs/<page>.md`, optionally
/// with `#<anchor>`), with the byte offset of each.
pub fn doc_citations(text: &str) -> Vec<(usize, String)> {
    static CITATION: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"\bdocs/[A-Za-z0-9_/-]+\.md(?:#[A-Za-z0-9_-]+)?").unwrap());
    CITATION
        .find_iter(text)
        .map(|m| (m.start(), m.as_str().to_string()))
        .collect()
}

/// Patterns of what a file must not say, each with what it means.
pub type Patterns = LazyLock<Vec<(Regex, &'static str)>>;

/// Compiles a list of (pattern, meaning).
fn compile(list: &[(&str, &'static str)]) -> Vec<(Regex, &'static str)> {
    list.iter()
        .map(|(p, why)| (Regex::new(p).expect("a valid pattern"), *why))
        .collect()
}

/// Citations of documents that are not in the repository (the patterns are written so that
/// they do not match themselves).
pub static OUTSIDE_DOCUMENTS: Patterns = LazyLock::new(|| {
    compile(&[
        (r"\.\./shared/", "a path outside the repository"),
        (
            r"DESIGN\s§",
            "a design document that is not in the repository",
        ),
        (
            r"\b(?:DESIGN|PEERS|MEASURED)\.md\b",
            "a document that is not in the repository",
        ),
    ])
});

/// Development history: it belongs in commit messages, not in the product (the patterns are
/// written so that they do not match themselves).
pub static HISTORY: Patterns = LazyLock::new(|| {
    compile(&[
        (r"(?i)\bissues?\s#?\d", "an issue number"),
        (
            r"(?i)\b(?:this|that|previous|earlier|last|next|first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)\ssessions?\b",
            "a work session",
        ),
        (r"(?i)\bsessions?\sof\s\d", "a dated work session"),
        (
            r"(?i)\b(?:of|on|since|as\sof)\s20\d\d-\d\d-\d\d\b",
            "a date of work",
        ),
        (r"(?i)\bprevious\smain\b", "an earlier state of the branch"),
        (
            r"(?i)\bthis\s(?:2-core\s|2-vcpu\s|two-core\s)?(?:vm|2-core\smachine|2-vcpu\smachine)\b",
            "the machine the work was done on",
        ),
        (r"(?i)\bthe\sissue's\b", "an issue"),
        (
            r"(?i)\b(?:before|after)\sthis\s(?:work|change|session)\b",
            "a before/after of the work",
        ),
    ])
});

/// Every match of `patterns` in `text`: (line, what the pattern means, the matched text).
pub fn matches(patterns: &Patterns, text: &str) -> Vec<(usize, String, String)> {
    let mut out = Vec::new();
    for (re, why) in patterns.iter() {
        for m in re.find_iter(text) {
            out.push((
                line_of(text, m.start()),
                why.to_string(),
                m.as_str().to_string(),
            ));
        }
    }
    out.sort();
    out
}

/// The long flags in a program's `--help` text (`--help` and `--version` left out).
pub fn flags_in_help(help: &str) -> BTreeSet<String> {
    static FLAG: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"(?m)^\s+(?:-[A-Za-z0-9],\s+)?--([a-z0-9][a-z0-9-]*)").unwrap()
    });
    FLAG.captures_iter(help)
        .map(|c| c[1].to_string())
        .filter(|f| f != "help" && f != "version")
        .collect()
}

/// The subcommands a `--help` text lists (`help` left out).
pub fn subcommands_in_help(help: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_commands = false;
    for line in help.lines() {
        if line.trim_end() == "Commands:" {
            in_commands = true;
            continue;
        }
        if in_commands {
            let Some(name) = line
                .strip_prefix("  ")
                .and_then(|l| l.split_whitespace().next())
            else {
                break;
            };
            if name != "help" {
                out.push(name.to_string());
            }
        }
    }
    out
}

/// Whether `doc` mentions `word` as a whole token (not as the start of a longer name).
pub fn mentions(doc: &str, word: &str) -> bool {
    doc.match_indices(word).any(|(i, _)| {
        let next = doc[i + word.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_follow_github() {
        assert_eq!(
            slug("How the fair share is computed"),
            "how-the-fair-share-is-computed"
        );
        assert_eq!(
            slug("Job queue (gpushare-queue)"),
            "job-queue-gpushare-queue"
        );
        assert_eq!(
            slug("gpushare status, gpushare top"),
            "gpushare-status-gpushare-top"
        );
        assert_eq!(
            slug("The runtime's private tables"),
            "the-runtimes-private-tables"
        );
        assert_eq!(slug("Replay: the policies"), "replay-the-policies");
    }

    #[test]
    fn anchors_are_heading_slugs_numbered_when_repeated_and_explicit_ids() {
        let a = anchors("# A `b` c\n\n## Tests\n\n## Tests\n\n1. <a id=\"rule\"></a>**Rule.**\n");
        for want in ["a-b-c", "tests", "tests-1", "rule"] {
            assert!(a.contains(want), "{want} in {a:?}");
        }
        assert_eq!(a.len(), 4);
    }

    #[test]
    fn links_are_found_with_their_lines_but_not_in_code() {
        let l =
            links("see [x](a.md#b)\n\n```\n[no](c.md)\n```\n![p](d.svg) <a href=\"e.md\">e</a>\n");
        let dests: Vec<&str> = l.iter().map(|l| l.dest.as_str()).collect();
        assert_eq!(dests, ["a.md#b", "d.svg", "e.md"]);
        assert_eq!(l[0].line, 1);
        assert_eq!(l[1].line, 6);
    }

    #[test]
    fn history_patterns_catch_history_and_not_the_product() {
        // Split, so that this file does not carry what it looks for.
        for bad in [
            concat!("as in issue", " 19"),
            concat!("DESIGN", " §2"),
            concat!("..", "/shared/notes"),
            concat!("Results (seventh ", "session of ", "2026-11-24)"),
            concat!("measured on this ", "2-core machine"),
            concat!("on the previous", " main"),
            concat!("the issue", "'s figure"),
        ] {
            let hits = matches(&HISTORY, bad).len() + matches(&OUTSIDE_DOCUMENTS, bad).len();
            assert!(hits > 0, "{bad:?} not caught");
        }
        for fine in [
            "a WebDriver session",
            "user.slice/session-1.scope",
            "runs on this machine's GPUs",
            "the turn before it",
            "utc(951_782_400.0) is 2000-02-29 00:00:00",
        ] {
            assert!(matches(&HISTORY, fine).is_empty(), "{fine:?} caught");
        }
    }

    #[test]
    fn flags_and_subcommands_are_read_from_help() {
        let help = "Usage: x <COMMAND>\n\nCommands:\n  run    Run it\n  serve  Serve\n  help   Print\n\nOptions:\n  -f, --follow       Keep going\n      --no-alone     Skip\n  -h, --help         Print help\n  -V, --version      Print version\n";
        assert_eq!(subcommands_in_help(help), ["run", "serve"]);
        let f: Vec<String> = flags_in_help(help).into_iter().collect();
        assert_eq!(f, ["follow", "no-alone"]);
        assert!(mentions("`--no-alone` skips", "--no-alone"));
        assert!(!mentions("`--no-alone` skips", "--no"));
    }
}
