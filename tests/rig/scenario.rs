//! The outbox scenario shared by the MySQL end-to-end tests: schema, deterministic rows, setup of
//! MariaDB + broker + outboxd, and the checks on what reached Kafka.

use outboxd::audit::matching::{Matcher, Rank, Record};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use super::{
    consume_to_end, create_topic, Broker, Consumed, Flavor, Mysqld, Outboxd, PAUSE, ROUND,
};

pub const LIMIT: Duration = Duration::from_secs(120);

pub const SCHEMA: &str = "
CREATE DATABASE app;
CREATE TABLE app.outbox (
  id BINARY(16) NOT NULL PRIMARY KEY,
  aggregatetype VARCHAR(255) NOT NULL,
  aggregateid VARCHAR(255) NOT NULL,
  type VARCHAR(255) NOT NULL,
  payload LONGTEXT,
  created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
CREATE TABLE app.legacy (
  id INT AUTO_INCREMENT PRIMARY KEY,
  name VARCHAR(100) CHARACTER SET latin1,
  raw BINARY(16),
  blob_col BLOB
) ENGINE=InnoDB;
";

pub struct Env {
    pub db: Mysqld,
    pub broker: Broker,
    pub outboxd: Outboxd,
}

pub fn setup(name: &str, extra_config: &str) -> Env {
    setup_with_http(name, extra_config, "")
}

/// [`setup`] on the server `flavor` names.
pub fn setup_on(flavor: Flavor, name: &str, extra_config: &str) -> Env {
    setup_on_with_http(flavor, name, extra_config, "")
}

pub fn setup_with_http(name: &str, extra_config: &str, http_listen: &str) -> Env {
    setup_on_with_http(Flavor::MariaDb, name, extra_config, http_listen)
}

pub fn setup_on_with_http(
    flavor: Flavor,
    name: &str,
    extra_config: &str,
    http_listen: &str,
) -> Env {
    let db = Mysqld::start(flavor, &[]);
    db.sql_socket(SCHEMA);
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let body = config_body(
        &db.cdc_url(),
        &broker.bootstrap(),
        extra_config,
        http_listen,
    );
    let outboxd = Outboxd::new(name, &body);
    Env {
        db,
        broker,
        outboxd,
    }
}

/// The `[source]`, `[kafka]` and `[http]` sections for a test pipeline (`extra_kafka` goes into `[kafka]`).
pub fn config_body(url: &str, bootstrap: &str, extra_kafka: &str, http_listen: &str) -> String {
    config_with_kafka(
        url,
        &format!("brokers = \"{bootstrap}\"\n{extra_kafka}"),
        http_listen,
    )
}

/// The same with the whole `[kafka]` section given (e.g. [`super::Broker::sasl_client`]'s keys).
pub fn config_with_kafka(url: &str, kafka: &str, http_listen: &str) -> String {
    format!(
        "[source]\nkind = \"mysql\"\nurl = \"{url}\"\ntables = [\"app.outbox\"]\nserver_id = 99\nheartbeat_interval_ms = 1000\n\
         [kafka]\n{kafka}\n[http]\nlisten = \"{http_listen}\"\n"
    )
}

/// The row with sequence number `n`: its id, aggregate type, key and payload.
pub fn event(n: u64) -> (String, &'static str, String, String) {
    let id = format!("{n:032x}");
    let kind = if n.is_multiple_of(3) {
        "customer"
    } else {
        "order"
    };
    let key = format!("key-{}", n % 17);
    let payload = format!(r#"{{"n":{n},"note":"café 🎉"}}"#);
    (id, kind, key, payload)
}

pub fn insert_sql(n: u64) -> String {
    let (id, kind, key, payload) = event(n);
    format!(
        "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES (UNHEX('{id}'), '{kind}', '{key}', 'Created', '{payload}');"
    )
}

/// A script committing rows `from..to` in transactions of `per_txn` rows, each row written by `insert`.
pub fn transactions(from: u64, to: u64, per_txn: u64, insert: impl Fn(u64) -> String) -> String {
    let mut script = String::new();
    let mut n = from;
    while n < to {
        script.push_str("BEGIN;");
        for m in n..(n + per_txn).min(to) {
            script.push_str(&insert(m));
        }
        script.push_str("COMMIT;\n");
        n += per_txn;
    }
    script
}

/// Commits rows `from..to` in transactions of `per_txn` rows.
/// One transaction of rows `ids` whose routing value (`bad topic`) makes no valid topic, queue or
/// subject name: each is a dead letter the router makes, none has a usable destination.
pub fn insert_unroutable_rows(db: &Mysqld, ids: std::ops::Range<u64>) {
    let values: Vec<String> = ids
        .map(|n| {
            format!(
                "(UNHEX('{}'), 'bad topic', 'k', 'Created', '{{}}')",
                uuid_of(n).replace('-', "")
            )
        })
        .collect();
    db.sql_socket(&format!(
        "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES {};",
        values.join(", ")
    ));
}

pub fn insert_rows(db: &Mysqld, from: u64, to: u64, per_txn: u64) {
    db.sql_socket(&transactions(from, to, per_txn, insert_sql));
}

pub fn consume_all(env: &Env, expected: usize) -> Vec<Consumed> {
    consume_events(&env.broker.bootstrap(), expected)
}

/// Reads both event topics until `expected` records arrived (or [`LIMIT`] passed).
pub fn consume_events(bootstrap: &str, expected: usize) -> Vec<Consumed> {
    consume_until(bootstrap, |all| all.len() >= expected)
}

/// Reads both event topics until `expected` distinct events (by their `id` header) arrived, or
/// [`LIMIT`] passed: after crashes, duplicates must not make a run look complete while rows are
/// still on their way.
pub fn consume_distinct_events(bootstrap: &str, expected: usize) -> Vec<Consumed> {
    consume_until(bootstrap, |all| {
        let ids: std::collections::HashSet<Option<String>> =
            all.iter().map(|r| r.header("id")).collect();
        ids.len() >= expected
    })
}

fn consume_until(bootstrap: &str, done: impl Fn(&[Consumed]) -> bool) -> Vec<Consumed> {
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let all: Vec<Consumed> = ["outbox.event.order", "outbox.event.customer"]
            .iter()
            .flat_map(|topic| consume_to_end(&[("bootstrap.servers", bootstrap)], topic, ROUND))
            .collect();
        if done(&all) || std::time::Instant::now() > deadline {
            return all;
        }
        std::thread::sleep(PAUSE);
    }
}

pub fn uuid_of(n: u64) -> String {
    let hex = format!("{n:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

pub fn n_of(record: &Consumed) -> u64 {
    let id = record.header("id").expect("id header").replace('-', "");
    u128::from_str_radix(&id, 16).unwrap() as u64
}

/// Asserts every row in `range` arrived (at least once), correctly formed; returns the duplicate count.
pub fn check_records(records: &[Consumed], range: std::ops::Range<u64>) -> usize {
    for r in records {
        let position = r.header("outboxd.position").unwrap();
        assert!(
            is_gtid_origin(&position),
            "position header {position:?} of row {}",
            n_of(r)
        );
    }
    check_records_by(records, range, |n| event(n).3)
}

/// The transaction's GTID as the `outboxd.position` header names it: MariaDB's `gtid:0-1-SEQ` (the
/// rig's domain 0, server 1) or MySQL's `gtid:UUID:GNO`.
fn is_gtid_origin(position: &str) -> bool {
    let number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if let Some(seq) = position.strip_prefix("gtid:0-1-") {
        return number(seq);
    }
    let Some((uuid, gno)) = position
        .strip_prefix("gtid:")
        .and_then(|g| g.rsplit_once(':'))
    else {
        return false;
    };
    uuid::Uuid::parse_str(uuid).is_ok() && number(gno)
}

/// Like [`check_records`], with the payload bytes each row is expected to arrive with (Postgres
/// renders jsonb in its own canonical form).
pub fn check_records_by(
    records: &[Consumed],
    range: std::ops::Range<u64>,
    payload_of: impl Fn(u64) -> String,
) -> usize {
    for r in records {
        let n = n_of(r);
        let (_, kind, key, _) = event(n);
        let payload = payload_of(n);
        assert_eq!(r.topic, format!("outbox.event.{kind}"), "topic of row {n}");
        assert_eq!(r.key.as_deref(), Some(key.as_bytes()), "key of row {n}");
        assert_eq!(
            r.value.as_deref(),
            Some(payload.as_bytes()),
            "value of row {n}"
        );
        assert_eq!(r.header("id").unwrap(), uuid_of(n), "id header of row {n}");
        assert!(
            r.header("outboxd.position").is_some(),
            "position header of row {n}"
        );
    }
    // The matching `outboxd audit` does: one implementation.
    let mut matcher = Matcher::new();
    for n in range.clone() {
        let topic = format!("outbox.event.{}", event(n).1);
        matcher.expect(&uuid_of(n), Some(&topic), &format!("row {n}"));
    }
    for r in records {
        matcher.observe(audit_record(r, &r.header("id"), None));
    }
    let outcome = matcher.finish();
    let missing: Vec<&str> = outcome.missing.iter().map(|a| a.place.as_str()).collect();
    assert!(
        missing.is_empty(),
        "{} rows never arrived, first: {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    outcome.extra_records() as usize
}

/// A consumed record as `outboxd audit`'s matcher takes it.
fn audit_record<'a>(r: &'a Consumed, id: &'a Option<String>, rank: Option<&'a Rank>) -> Record<'a> {
    Record {
        id: id.as_deref(),
        topic: &r.topic,
        partition: r.partition,
        offset: r.offset,
        key: r.key.as_deref(),
        rank,
    }
}

/// Per key, the first occurrences of rows arrive in commit (= sequence) order.
pub fn check_per_key_order(records: &[Consumed]) {
    check_per_key_order_by(records, |n| n);
}

/// Per key, first occurrences arrive in commit order, where `rank(n)` is row `n`'s place in it.
pub fn check_per_key_order_by(records: &[Consumed], rank: impl Fn(u64) -> u64) {
    let mut by_partition: BTreeMap<(String, i32), Vec<&Consumed>> = BTreeMap::new();
    for r in records {
        by_partition
            .entry((r.topic.clone(), r.partition))
            .or_default()
            .push(r);
    }
    // The matching `outboxd audit` does, with the rank the test knows for each row.
    let mut matcher = Matcher::new();
    let mut expected = std::collections::HashSet::new();
    for r in records {
        // A redelivered row is one row: expected once, or the matcher sees an id collision.
        let id = r.header("id").unwrap();
        if expected.insert(id.clone()) {
            matcher.expect(&id, Some(&r.topic), "");
        }
    }
    for (_, mut rs) in by_partition {
        rs.sort_by_key(|r| r.offset);
        for r in rs {
            let id = r.header("id");
            let rank = Rank::new("", u128::from(rank(n_of(r))));
            matcher.observe(audit_record(r, &id, Some(&rank)));
        }
    }
    let disorder = matcher.finish().disorder;
    assert!(
        disorder.is_empty(),
        "rows arrived out of key order: {disorder:#?}"
    );
}

/// The statements each database writes for [`mixed_transactions`].
pub struct MixedSql {
    /// INSERT of outbox row `n`.
    pub insert: fn(u64) -> String,
    /// A write to a non-outbox table inside transaction `i` (odd types and character sets).
    pub other_in_txn: fn(u64) -> String,
    /// An UPDATE of outbox row `n` (must be ignored).
    pub touch: fn(u64) -> String,
    /// A transaction of its own on the non-outbox table.
    pub other_alone: fn(u64) -> String,
}

/// 1,000 outbox rows: 100 one-row transactions, 5 of 100 rows, and 100 of 4 rows that also write
/// another table and update an outbox row, interleaved with other-table-only transactions.
pub fn mixed_transactions(sql: &MixedSql) -> String {
    let mut script = String::new();
    let mut n = 0;
    for _ in 0..100 {
        script.push_str(&format!("BEGIN;{}COMMIT;\n", (sql.insert)(n)));
        n += 1;
    }
    for _ in 0..5 {
        script.push_str("BEGIN;");
        for _ in 0..100 {
            script.push_str(&(sql.insert)(n));
            n += 1;
        }
        script.push_str("COMMIT;\n");
    }
    for i in 0..100 {
        script.push_str("BEGIN;");
        script.push_str(&(sql.other_in_txn)(i));
        for _ in 0..4 {
            script.push_str(&(sql.insert)(n));
            n += 1;
        }
        script.push_str(&(sql.touch)(n - 1));
        script.push_str("COMMIT;\n");
        script.push_str(&(sql.other_alone)(i));
    }
    assert_eq!(n, 1000);
    script
}

/// Prints one line of the reliability table (collected by `scripts/reliability.sh` into RELIABILITY.md):
/// scenario, what was done, rows committed, records received, lost, duplicates, and the time from the
/// fault's end (or the restart) until every row had arrived.
pub fn report(
    scenario: &str,
    action: &str,
    sent: u64,
    records: &[Consumed],
    recovery_started: std::time::Instant,
) {
    report_rows(scenario, action, 0..sent, records, recovery_started);
}

/// [`report`] for a scenario whose committed rows are `expected` (not always `0..n`: rolled-back
/// rows are never expected).
pub fn report_rows(
    scenario: &str,
    action: &str,
    expected: impl IntoIterator<Item = u64>,
    records: &[Consumed],
    recovery_started: std::time::Instant,
) {
    let expected: Vec<u64> = expected.into_iter().collect();
    let sent = expected.len();
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for r in records {
        *seen.entry(n_of(r)).or_default() += 1;
    }
    let lost = expected.iter().filter(|n| !seen.contains_key(n)).count();
    let duplicates: usize = seen.values().map(|c| c - 1).sum();
    println!(
        "RELIABILITY|{scenario}|{action}|{sent}|{}|{lost}|{duplicates}|{:.1}",
        records.len(),
        recovery_started.elapsed().as_secs_f64()
    );
}

/// Commits rows `0..total` from a background thread through `socket`, in transactions whose sizes cycle
/// through `sizes`, `per_call` transactions per client call: a steady load while a test breaks things.
pub fn spawn_writer(
    socket: std::path::PathBuf,
    total: u64,
    sizes: &'static [u64],
    per_call: usize,
) -> std::thread::JoinHandle<()> {
    spawn_writer_from(socket, 0, total, sizes, per_call)
}

/// [`spawn_writer`] for rows `from..total`.
pub fn spawn_writer_from(
    socket: std::path::PathBuf,
    from: u64,
    total: u64,
    sizes: &'static [u64],
    per_call: usize,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let (mut n, mut i) = (from, 0usize);
        while n < total {
            let mut script = String::new();
            for _ in 0..per_call {
                if n >= total {
                    break;
                }
                let end = (n + sizes[i % sizes.len()]).min(total);
                i += 1;
                script.push_str("BEGIN;");
                for m in n..end {
                    script.push_str(&insert_sql(m));
                }
                script.push_str("COMMIT;\n");
                n = end;
            }
            super::mysqld::sql_at(&socket, &script);
        }
    })
}

/// `kills` times: waits 0.2..1 s (pseudo-random, from a fixed seed so runs compare), then
/// `kill -9` and a restart.
pub fn kill_9_and_restart(outboxd: &mut Outboxd, kills: usize) {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..kills {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let pause = Duration::from_millis(200 + seed % 800);
        let until = std::time::Instant::now() + pause;
        super::wait_until("the pause before a kill", pause * 2, || {
            std::time::Instant::now() >= until
        });
        outboxd.kill9();
        outboxd.start();
    }
}

/// Temp files a checkpoint write left in `dir` (there must be none).
pub fn leftover_temp_files(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".tmp"))
        .collect()
}
