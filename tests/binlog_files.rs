//! Binlog files: the MySQL 8/9 and MariaDB fixtures through the file source, `replay --binlog-file
//! --dry-run`, damaged files, and a file of the private MariaDB replayed to the same records the live
//! source produced.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::rig::scenario::{consume_all, insert_rows, n_of, setup, uuid_of};
use outboxd::source::mysql::BinlogFileSource;
use outboxd::source::Change;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/binlogs")
        .join(name)
}

/// Runs `outboxd replay --binlog-file FILE --dry-run` with a config holding `source_and_route`.
fn dry_run(source_and_route: &str, files: &[PathBuf]) -> (bool, Vec<serde_json::Value>, String) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("outboxd.toml");
    std::fs::write(
        &config,
        format!(
            "name = \"audit\"\n{source_and_route}\n[kafka]\nbrokers = \"127.0.0.1:1\"\n[http]\nlisten = \"\"\n"
        ),
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outboxd"));
    cmd.arg("--config")
        .arg(&config)
        .args(["replay", "--dry-run"]);
    for f in files {
        cmd.arg("--binlog-file").arg(f);
    }
    let out = cmd.output().unwrap();
    let lines = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (
        out.status.success(),
        lines,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Every change of `file` for `table`, read through the library.
fn changes(file: &str, table: &str) -> (Vec<Change>, outboxd::source::Ignored) {
    let mut source =
        BinlogFileSource::open(vec![fixture(file)], [table.to_string()], None).unwrap();
    let mut out = Vec::new();
    loop {
        match source.next_change().unwrap() {
            Change::Exhausted => return (out, source.ignored()),
            change => out.push(change),
        }
    }
}

const POSITIONAL: &str =
    "[route]\nby = \"@0\"\ntopic = \"t\"\nkey = \"@0\"\npayload = \"@1\"\nid = \"@0\"";

#[test]
fn a_mariadb_outbox_file_yields_its_two_rows_with_their_gtids() {
    let (ok, lines, stderr) = dry_run(
        "[source]\nkind = \"mysql\"\nurl = \"mysql://x@127.0.0.1:1/x\"\ntables = [\"toddy_test.outbox\"]\n\
         [route]\nby = \"topic\"\nkey = \"event_type\"\npayload = \"event\"",
        &[fixture("mariadb-bin.000001")],
    );
    assert!(ok, "{stderr}");
    assert_eq!(lines.len(), 2, "{lines:?}");
    let ids: Vec<&str> = lines
        .iter()
        .map(|l| l["headers"]["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["62", "63"]);
    let positions: Vec<&str> = lines
        .iter()
        .map(|l| l["headers"]["outboxd.position"].as_str().unwrap())
        .collect();
    assert_eq!(positions, ["gtid:0-1-1", "gtid:0-1-2"]);
    assert_eq!(lines[0]["topic"], "outbox.event.foo");
    assert_eq!(lines[0]["value"], r#"{"foo":1}"#);
    // The boundaries carry the MariaDB GTID state.
    let (changes, _) = changes("mariadb-bin.000001", "toddy_test.outbox");
    let commits: Vec<String> = changes
        .iter()
        .filter_map(|c| match c {
            Change::Commit(b) => Some(b.position.binlog().unwrap().gtid_text().unwrap()),
            _ => None,
        })
        .collect();
    assert_eq!(commits, ["0-1-1", "0-1-2"]);
}

#[test]
fn mysql_binary_json_decodes_to_the_text_mysql_prints_and_updates_are_counted() {
    let (ok, lines, stderr) = dry_run(
        &format!("[source]\nkind = \"mysql\"\nurl = \"mysql://x@127.0.0.1:1/x\"\ntables = [\"mysql.t\"]\n{POSITIONAL}"),
        &[fixture("json.binlog.000001")],
    );
    assert!(ok, "{stderr}");
    let values: Vec<&str> = lines.iter().map(|l| l["value"].as_str().unwrap()).collect();
    assert_eq!(
        values,
        [
            r#"{"age": 24, "data": "xxxxxxxxxx", "name": "Joe"}"#,
            r#"{"age": 32, "data": "yyyyyyyyyy", "name": "Sue"}"#,
            r#"{"age": 40, "data": "zzzzzzzzzz", "name": "Pete"}"#,
            r#"{"age": 24, "data": "xxxxxxxxxx", "name": "Joe"}"#,
            r#"{"age": 32, "data": "yyyyyyyyyy", "name": "Sue"}"#,
            r#"{"age": 40, "data": "zzzzzzzzzz", "name": "Pete"}"#,
        ]
    );
    let (_, ignored) = changes("json.binlog.000001", "mysql.t");
    assert_eq!(
        ignored.updates, 2,
        "UPDATE_ROWS and PARTIAL_UPDATE_ROWS are ignored and counted"
    );

    let (ok, lines, stderr) = dry_run(
        "[source]\nkind = \"mysql\"\nurl = \"mysql://x@127.0.0.1:1/x\"\ntables = [\"foo.test\"]\n\
         [route]\nby = \"a\"\ntopic = \"t\"\nkey = \"a\"\npayload = \"a\"\nid = \"a\"",
        &[fixture("json-opaque.binlog")],
    );
    assert!(ok, "{stderr}");
    let values: Vec<&str> = lines.iter().map(|l| l["value"].as_str().unwrap()).collect();
    assert_eq!(
        values,
        [
            r#"{"a": "base64:type15:VQ=="}"#,
            r#"{"b": "2012-03-18"}"#,
            r#"{"c": "2012-03-18 11:30:45.000000"}"#,
            r#"{"c": "87:31:46.654321"}"#,
            r#"{"d": 123.456}"#,
            r#"{"e": 9.00}"#,
            r#"{"e": [0, 1, true, false]}"#,
            r#"{"e": null}"#,
        ]
    );
}

#[test]
fn rows_inside_a_compressed_transaction_are_produced() {
    let (ok, lines, stderr) = dry_run(
        &format!(
            "[source]\nkind = \"mysql\"\nurl = \"mysql://x@127.0.0.1:1/x\"\ntables = [\"test.tb1\"]\n{}",
            POSITIONAL.replace("@1", "@0")
        ),
        &[fixture("transaction_compression.000001")],
    );
    assert!(ok, "{stderr}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["key"], "1");
    assert_eq!(lines[0]["headers"]["id"], "1");
}

#[test]
fn a_tagged_gtid_is_tracked_in_the_position() {
    let (changes, _) = changes("binlog_transaction_with_GTID_TAG.000001", "test.orders");
    let rows = changes
        .iter()
        .filter(|c| matches!(c, Change::Row(_)))
        .count();
    assert_eq!(rows, 1);
    let commit = changes
        .iter()
        .find_map(|c| match c {
            Change::Commit(b) => Some(b.position.clone()),
            _ => None,
        })
        .unwrap();
    let gtids = commit.binlog().unwrap().gtid_text().unwrap();
    assert_eq!(gtids, "55778904-0299-11f1-b1b8-4ef0c4956feb:1-13:mytag:1-3");
}

#[test]
fn truncated_and_corrupt_files_fail_clearly_without_a_panic() {
    for (file, needle) in [
        ("binlog_truncated_event.000001", "offset 4"),
        ("corrupt-relay-bin.000624", "offset 91204"),
    ] {
        let (ok, _, stderr) = dry_run(
            &format!("[source]\nkind = \"mysql\"\nurl = \"mysql://x@127.0.0.1:1/x\"\ntables = [\"a.b\"]\n{POSITIONAL}"),
            &[fixture(file)],
        );
        assert!(!ok, "{file}");
        assert!(
            stderr.contains(file) && stderr.contains(needle),
            "{file}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{file}: {stderr}");
    }
    let (ok, _, stderr) = dry_run(
        &format!("[source]\nkind = \"mysql\"\nurl = \"mysql://x@127.0.0.1:1/x\"\ntables = [\"a.b\"]\n{POSITIONAL}"),
        &[fixture("README.md")],
    );
    assert!(!ok && stderr.contains("not a binlog file"), "{stderr}");
}

#[test]
fn a_file_of_the_live_server_replays_to_the_records_the_live_source_produced() {
    let mut env = setup("files", "");
    // Files carry column names only with FULL row metadata (there is no server to ask).
    env.db.sql_socket("SET GLOBAL binlog_row_metadata = FULL;");
    env.outboxd.start();
    insert_rows(&env.db, 0, 60, 4);
    let live = consume_all(&env, 60);
    assert_eq!(live.len(), 60);
    env.outboxd.stop();
    let copy = env.outboxd.dir_path().join("mariadb-bin.000001");
    std::fs::copy(env.db.dir().join("data/mariadb-bin.000001"), &copy).unwrap();

    let out = env.outboxd.command_output(&[
        "replay",
        "--dry-run",
        "--binlog-file",
        copy.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let replayed: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut from_file: Vec<(String, String, String, String)> = replayed
        .iter()
        .map(|l| {
            (
                l["topic"].as_str().unwrap().to_string(),
                l["key"].as_str().unwrap().to_string(),
                l["value"].as_str().unwrap().to_string(),
                l["headers"]["id"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let mut from_live: Vec<(String, String, String, String)> = live
        .iter()
        .map(|r| {
            (
                r.topic.clone(),
                String::from_utf8(r.key.clone().unwrap()).unwrap(),
                String::from_utf8(r.value.clone().unwrap()).unwrap(),
                uuid_of(n_of(r)),
            )
        })
        .collect();
    from_file.sort();
    from_live.sort();
    assert_eq!(from_file, from_live);

    // And for real: the file's rows go to Kafka through the normal sink.
    let out = env
        .outboxd
        .command_output(&["replay", "--binlog-file", copy.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("replayed 60 record(s)"));
    assert_eq!(consume_all(&env, 120).len(), 120);
}

/// A file replay keeps its progress in a scratch checkpoint that starts at the source's start: a
/// replay retried after a broker hiccup resumes there, so that start must be `--from`, not the top of
/// the file (which would re-send everything before `--from`).
#[test]
fn a_file_source_opened_at_from_starts_there_and_yields_only_what_follows() {
    let (all, _) = changes("mariadb-bin.000001", "toddy_test.outbox");
    let first_commit = all
        .iter()
        .find_map(|c| match c {
            Change::Commit(b) => Some(b.position.clone()),
            _ => None,
        })
        .unwrap();
    let text = format!(
        "{}:{}",
        first_commit.binlog().unwrap().file,
        first_commit.binlog().unwrap().pos
    );
    let from = outboxd::source::parse_position(outboxd::config::SourceKind::Mysql, &text).unwrap();
    let mut source = BinlogFileSource::open(
        vec![fixture("mariadb-bin.000001")],
        ["toddy_test.outbox".to_string()],
        Some(&from),
    )
    .unwrap();
    assert_eq!(source.start().to_string(), text, "the replay's start");
    let mut rows = Vec::new();
    loop {
        match source.next_change().unwrap() {
            Change::Exhausted => break,
            Change::Row(r) => rows.push(r.get("id").cloned()),
            _ => {}
        }
    }
    assert_eq!(rows.len(), 1, "only the row after --from: {rows:?}");
}
