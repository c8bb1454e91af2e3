//! The files in `deploy/` stay in step with outboxd: the Grafana dashboard and the Prometheus alert
//! rules parse, and every `outboxd_*` series they query is one that `/metrics` serves (taken from
//! the library: a fresh `Metrics` with every recording method called once, rendered as `/metrics`
//! renders it); the Dockerfile builds what `cargo build --release` builds unless told otherwise.

use std::collections::BTreeSet;

fn repo_file(path: &str) -> String {
    let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("cannot read {}: {e}", full.display()))
}

/// The sample names `/metrics` serves (counters with `_total`, the histogram's `_bucket`/`_sum`/
/// `_count`), from the registry with every family touched (the one the metrics reference is made
/// from).
fn exported() -> BTreeSet<String> {
    let text = outboxd::reference::metrics::sample().render();
    let names: BTreeSet<String> = text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l[..l.find(['{', ' ']).unwrap_or(l.len())].to_string())
        .collect();
    // Every family declared must have shown a sample (a new metric must be touched in `sample`).
    for family in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let family = family.split_whitespace().next().unwrap_or_default();
        assert!(
            names.iter().any(|n| n.starts_with(family)),
            "{family} rendered no sample: call its recording method in outboxd::reference::metrics::sample"
        );
    }
    names
}

/// The `outboxd_*` names an expression refers to.
fn referenced(expr: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("outboxd_") {
        let boundary = at == 0 || !rest[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_');
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if boundary {
            found.push(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    found
}

fn exprs_in(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => exprs_in(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| exprs_in(v, out)),
        _ => {}
    }
}

#[test]
fn the_grafana_dashboard_queries_only_series_outboxd_exports() {
    let exported = exported();
    let dashboard: serde_json::Value =
        serde_json::from_str(&repo_file("deploy/grafana/outboxd.json")).expect("valid JSON");
    let mut exprs = Vec::new();
    exprs_in(&dashboard, &mut exprs);
    assert!(exprs.len() >= 8, "the dashboard has its panels: {exprs:?}");
    for expr in &exprs {
        let names = referenced(expr);
        assert!(!names.is_empty(), "{expr} queries no outboxd series");
        for name in names {
            assert!(
                exported.contains(&name),
                "{name} (in {expr}) is not exported: {exported:?}"
            );
        }
        assert!(
            expr.contains("$pipeline"),
            "{expr} does not filter on $pipeline"
        );
    }
}

#[test]
fn every_alert_rule_is_complete_and_queries_only_series_outboxd_exports() {
    let exported = exported();
    let runbook_page = repo_file("docs/operations/runbook.md");
    let troubleshooting = repo_file("docs/operations/troubleshooting.md");
    let rules: serde_json::Value =
        serde_norway::from_str(&repo_file("deploy/prometheus/alerts.yml")).expect("valid YAML");
    let rules: Vec<&serde_json::Value> = rules["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules"))
        .collect();
    assert!(
        rules.len() >= 5,
        "the rules cover lag, checkpoint age, readiness, dead letters, reconnects"
    );
    for rule in rules {
        let alert = rule["alert"].as_str().expect("every rule is an alert");
        let expr = rule["expr"]
            .as_str()
            .unwrap_or_else(|| panic!("{alert}: expr"));
        for name in referenced(expr) {
            assert!(exported.contains(&name), "{alert}: {name} is not exported");
        }
        assert!(
            ["critical", "warning", "info"]
                .contains(&rule["labels"]["severity"].as_str().unwrap_or("")),
            "{alert}: labels.severity"
        );
        assert!(
            rule["annotations"]["summary"].is_string(),
            "{alert}: summary"
        );
        let runbook = rule["annotations"]["runbook"].as_str().unwrap_or_default();
        let anchor = alert.to_lowercase();
        assert_eq!(
            runbook,
            format!(
                "https://github.com/outboxd/outboxd/blob/main/docs/operations/runbook.md#{anchor}"
            ),
            "{alert}: annotations.runbook points at its own entry of the runbook"
        );
        assert!(
            runbook_page
                .lines()
                .any(|l| l.trim() == format!("## {alert}")),
            "{alert}: docs/operations/runbook.md has no `## {alert}` entry"
        );
        if let Some(entry) = rule["annotations"]["runbook_entry"].as_str() {
            assert!(
                troubleshooting.contains(entry),
                "{alert}: {entry:?} is not in docs/operations/troubleshooting.md"
            );
        }
    }
}

#[test]
fn the_alert_rules_pass_promtool_when_it_is_installed() {
    // scripts/install-test-deps.sh unpacks promtool from Debian's prometheus package.
    let promtool = std::env::var_os("OUTBOXD_PROMTOOL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
                .join(".cache/outboxd-test/promtool")
        });
    if !promtool.exists() {
        eprintln!("promtool not installed: the rules got the YAML check only");
        return;
    }
    let rules =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus/alerts.yml");
    let out = std::process::Command::new(&promtool)
        .args(["check", "rules"])
        .arg(&rules)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success() && text.contains("SUCCESS"), "{text}");
}

/// The image's `SINKS` build argument defaults to Cargo.toml's default features (the image is the
/// full binary unless told otherwise) and is what the build's `--features` takes. Without Docker
/// here, the build itself is not run.
#[test]
fn the_dockerfile_builds_the_default_sinks_unless_told_otherwise() {
    let dockerfile = repo_file("deploy/Dockerfile");
    let arg = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("ARG SINKS="))
        .expect("deploy/Dockerfile has ARG SINKS=...");
    let mut sinks: Vec<&str> = arg.trim_matches('"').split_whitespace().collect();
    sinks.sort();
    let manifest: toml::Value = toml::from_str(&repo_file("Cargo.toml")).unwrap();
    let mut default: Vec<&str> = manifest["features"]["default"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    default.sort();
    assert_eq!(sinks, default, "ARG SINKS in deploy/Dockerfile");
    assert!(
        dockerfile
            .contains("cargo build --release --locked --no-default-features --features \"$SINKS\""),
        "{dockerfile}"
    );
}
