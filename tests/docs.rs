//! The documentation stays true to the code: the generated references (configuration, command
//! line, man page, metrics) are what the code makes now; every config key is described and every
//! shipped config uses only real keys; every link and anchor in the Markdown resolves; every test
//! a page names as its proof exists; and the user docs carry no issue or session numbers.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use regex::Regex;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Every Markdown file of the docs: README, the top-level guides and everything under docs/.
fn markdown_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = [
        "README.md",
        "CHANGELOG.md",
        "CONTRIBUTING.md",
        "ARCHITECTURE.md",
        "deploy/README.md",
    ]
    .iter()
    .map(|f| root().join(f))
    .filter(|p| p.exists())
    .collect();
    let mut stack = vec![root().join("docs")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The user docs: README and docs/ (not the contributors' files or the changelog).
fn user_docs() -> Vec<PathBuf> {
    markdown_files()
        .into_iter()
        .filter(|p| p.starts_with(root().join("docs")) || p.ends_with("README.md"))
        .collect()
}

/// The lines outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped,
/// spaces as `-`; a repeated heading gets `-1`, `-2`, ….
fn anchors(text: &str) -> BTreeSet<String> {
    let link = Regex::new(r"\[([^\]]*)\]\([^)]*\)").unwrap();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for line in prose(text) {
        let Some(heading) = line
            .strip_prefix('#')
            .map(|h| h.trim_start_matches('#'))
            .filter(|h| h.starts_with(' '))
        else {
            continue;
        };
        let heading = link.replace_all(heading.trim(), "$1");
        let slug: String = heading
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        out.insert(if *n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        *n += 1;
    }
    out
}

#[test]
fn the_generated_references_are_what_the_code_makes() {
    let mut stale = Vec::new();
    for (page, file) in [
        ("config", "configuration.md"),
        ("schema", "outboxd.schema.json"),
        ("cli", "cli.md"),
        ("man", "outboxd.1"),
        ("metrics", "metrics.md"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(["reference", page])
            .output()
            .unwrap();
        assert!(out.status.success(), "outboxd reference {page}: {out:?}");
        let path = root().join("docs/reference").join(file);
        let checked_in = std::fs::read(&path).unwrap_or_default();
        if checked_in != out.stdout {
            stale.push(format!("docs/reference/{file}"));
        }
    }
    assert!(
        stale.is_empty(),
        "{stale:?} differ from what the code makes: run scripts/gen-docs.sh and commit the result"
    );
}

#[test]
fn every_config_key_is_described() {
    let undocumented = outboxd::reference::config::undocumented();
    assert!(
        undocumented.is_empty(),
        "these config keys have no doc comment, so the configuration reference cannot say what they do: {undocumented:?}"
    );
}

/// The key paths a shipped config shows, set or commented out (`# key = …` under `[section]` or
/// `# [section]`), inline tables' keys included (`tls = { mode = … }` shows `source.tls.mode`).
fn shown_keys(text: &str) -> BTreeSet<String> {
    let section = Regex::new(r"^#?\s*\[\[?([A-Za-z0-9_.\-]+)\]\]?").unwrap();
    let key = Regex::new(r#"^#?\s*"?([A-Za-z0-9_.\-]+)"?\s*=\s*(.*)$"#).unwrap();
    let inner = Regex::new(r"([A-Za-z0-9_\-]+)\s*=").unwrap();
    let mut current = String::new();
    let mut keys = BTreeSet::new();
    for line in text.lines() {
        if let Some(c) = section.captures(line) {
            // `[[route.additional]]` is an array of tables: its keys are `route.additional[].…`.
            current = if line.contains("[[") {
                format!("{}[]", &c[1])
            } else {
                c[1].to_string()
            };
            continue;
        }
        let Some(c) = key.captures(line) else {
            continue;
        };
        let path = match current.strip_suffix("[]") {
            _ if current.is_empty() => c[1].to_string(),
            Some(array) => format!("{array}[].{}", &c[1]),
            None => format!("{current}.{}", &c[1]),
        };
        let value = c[2].trim_start();
        let array_of_tables = value.starts_with("[{");
        if value.starts_with('{') || array_of_tables {
            let inside = &value[..value.find('}').unwrap_or(value.len())];
            for k in inner.captures_iter(inside) {
                let sub = if array_of_tables { "[]." } else { "." };
                keys.insert(format!("{path}{sub}{}", &k[1]));
            }
        }
        keys.insert(path);
    }
    keys
}

/// A path as the schema names it: itself, or for a member of a free-form table
/// (`kafka.properties."x"`, `route.headers.eventType`) that table. A typo in a nested key
/// (`source.tls.mdoe`) is not a member of anything.
fn schema_key<'a>(
    path: &str,
    schema: &'a BTreeSet<String>,
    free_form: &BTreeSet<String>,
) -> Option<&'a String> {
    if let Some(found) = schema.get(path) {
        return Some(found);
    }
    free_form
        .iter()
        .find(|table| path.starts_with(&format!("{table}.")))
        .and_then(|table| schema.get(table))
}

#[test]
fn the_shipped_configs_use_only_real_keys_and_show_every_one() {
    let schema: BTreeSet<String> = outboxd::reference::config::key_paths()
        .into_iter()
        .collect();
    let free_form: BTreeSet<String> = outboxd::reference::config::free_form_paths()
        .into_iter()
        .collect();
    assert!(
        free_form.contains("kafka.properties") && free_form.contains("route.headers"),
        "{free_form:?}"
    );
    let mut shown = BTreeSet::new();
    let mut unknown = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("deploy"))
        .unwrap()
        .chain(std::fs::read_dir(root().join("deploy/compose")).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    assert!(files.len() >= 8, "the shipped configs: {files:?}");
    for file in &files {
        let text = read(file);
        let named = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("#:schema "))
            .unwrap_or_else(|| {
                panic!(
                    "{}: its first line names the schema for editors (#:schema …)",
                    file.display()
                )
            });
        assert!(
            file.parent().unwrap().join(named.trim()).exists(),
            "{}: #:schema {named} does not exist",
            file.display()
        );
        for path in shown_keys(&text) {
            match schema_key(&path, &schema, &free_form) {
                Some(key) => {
                    if file.to_string_lossy().contains(".example.") {
                        // [sqs] and [sns] are one struct: either section shows its keys.
                        shown.insert(key.replacen("sns.", "sqs.", 1));
                    }
                }
                None => unknown.push(format!("{}: {path}", file.display())),
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "keys the configuration does not have: {unknown:?}"
    );
    let missing: Vec<&String> = schema
        .iter()
        .filter(|k| !shown.contains(&k.replacen("sns.", "sqs.", 1)))
        .collect();
    assert!(
        missing.is_empty(),
        "keys no deploy/*.example.toml shows (set or as a comment): {missing:?}"
    );
}

#[test]
fn every_link_and_anchor_in_the_docs_resolves() {
    let link = Regex::new(r"\]\(([^)\s]+)\)").unwrap();
    let mut broken = Vec::new();
    let mut anchor_cache: BTreeMap<PathBuf, BTreeSet<String>> = BTreeMap::new();
    for file in markdown_files() {
        let text = read(&file);
        let dir = file.parent().unwrap();
        for line in prose(&text) {
            for c in link.captures_iter(line) {
                let target = &c[1];
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (path, anchor) = match target.split_once('#') {
                    Some((p, a)) => (p, Some(a)),
                    None => (target, None),
                };
                let resolved = if path.is_empty() {
                    file.clone()
                } else {
                    dir.join(path)
                };
                if !resolved.exists() {
                    broken.push(format!("{}: {target} (no such file)", file.display()));
                    continue;
                }
                if let Some(anchor) = anchor {
                    let known = anchor_cache
                        .entry(resolved.clone())
                        .or_insert_with(|| anchors(&read(&resolved)));
                    if !known.contains(anchor) {
                        broken.push(format!("{}: {target} (no such heading)", file.display()));
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_book_summary_lists_every_page() {
    let summary = read(&root().join("docs/SUMMARY.md"));
    let link = Regex::new(r"\]\(([^)\s#]+)\)").unwrap();
    let listed: BTreeSet<PathBuf> = link
        .captures_iter(&summary)
        .map(|c| root().join("docs").join(&c[1]))
        .collect();
    let pages: BTreeSet<PathBuf> = markdown_files()
        .into_iter()
        .filter(|p| p.starts_with(root().join("docs")) && !p.ends_with("SUMMARY.md"))
        .collect();
    let unlisted: Vec<_> = pages.difference(&listed).collect();
    assert!(
        unlisted.is_empty(),
        "pages docs/SUMMARY.md does not list: {unlisted:?}"
    );
}

/// Where a marker's test lives: `module::fn` in tests/module.rs, or `src/….rs::fn`.
fn test_exists(name: &str) -> bool {
    let Some((place, function)) = name.rsplit_once("::") else {
        return false;
    };
    let file = if place.starts_with("src/") {
        root().join(place)
    } else {
        root().join("tests").join(format!("{place}.rs"))
    };
    std::fs::read_to_string(file).is_ok_and(|text| text.contains(&format!("fn {function}(")))
}

#[test]
fn every_test_a_page_names_as_proof_exists() {
    let marker = Regex::new(r"<!--\s*test:\s*([A-Za-z0-9_:/.\-]+)\s*-->").unwrap();
    let mut named = 0;
    let mut missing = Vec::new();
    for file in markdown_files() {
        for c in marker.captures_iter(&read(&file)) {
            named += 1;
            if !test_exists(&c[1]) {
                missing.push(format!("{}: {}", file.display(), &c[1]));
            }
        }
    }
    assert!(named >= 20, "the docs name their proofs ({named} markers)");
    assert!(
        missing.is_empty(),
        "tests the docs name that do not exist:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_user_docs_are_short_at_the_top_and_free_of_work_notes() {
    let readme = read(&root().join("README.md"));
    let lines = readme.lines().count();
    assert!(
        lines <= 150,
        "README.md has {lines} lines (at most 150: details go to docs/)"
    );
    assert!(
        readme.contains("./scripts/test.sh"),
        "README names the test command CI runs"
    );
    let notes = Regex::new(r"(?i)\bsession \d+|\bissue #?\d+|(^|[\s(])#\d{2,4}\b").unwrap();
    let mut found = Vec::new();
    for file in user_docs() {
        for (n, line) in read(&file).lines().enumerate() {
            if let Some(m) = notes.find(line) {
                found.push(format!("{}:{}: {}", file.display(), n + 1, m.as_str()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "issue or session numbers in the user docs:\n{}",
        found.join("\n")
    );
}

#[test]
fn every_docs_page_the_program_names_exists() {
    let named = Regex::new(r#"docs/[a-z0-9_/\-]+\.md(#[a-z0-9_\-]+)?"#).unwrap();
    let old = Regex::new(r#"README ["\\]"#).unwrap();
    let mut missing = Vec::new();
    let mut stack = vec![root().join("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = read(&path);
            for (n, line) in text.lines().enumerate() {
                if line.trim_start().starts_with("//") {
                    continue;
                }
                if old.is_match(line) {
                    missing.push(format!(
                        "{}:{}: points at a README section (the docs live in docs/)",
                        path.display(),
                        n + 1
                    ));
                }
                for m in named.find_iter(line) {
                    let (page, anchor) = match m.as_str().split_once('#') {
                        Some((p, a)) => (p, Some(a)),
                        None => (m.as_str(), None),
                    };
                    let file = root().join(page);
                    let ok =
                        file.exists() && anchor.is_none_or(|a| anchors(&read(&file)).contains(a));
                    if !ok {
                        missing.push(format!("{}:{}: {}", path.display(), n + 1, m.as_str()));
                    }
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "pages the program's messages name that do not exist:\n{}",
        missing.join("\n")
    );
}
