//! The SQS and SNS sinks end to end, on a private moto server (PyPI) and MariaDB or PostgreSQL:
//! every row stored with its key as the FIFO message group, its id as the de-duplication id and
//! attribute, in per-key order; a queue that does not exist and a message over a queue's size
//! dead-lettered or stopping outboxd; partial batch failures, throttling (fail points: moto has
//! neither), kill -9 of outboxd and a frozen endpoint lose nothing and reorder nothing; the AWS
//! secret is never printed.

use std::time::Duration;

use crate::rig::moto::{config_with_aws, Got, Moto, SECRET_KEY, SESSION_TOKEN};
use crate::rig::scenario::{
    check_per_key_order, check_records, insert_rows, insert_unroutable_rows, kill_9_and_restart,
    n_of, spawn_writer, transactions, SCHEMA,
};
use crate::rig::{free_port, http_get, wait_until, Consumed, Mysqld, Outboxd};

const READ_LIMIT: Duration = Duration::from_secs(90);

/// The route for SQS and SNS names (no dots but `.fifo`).
const FIFO_ROUTE: &str = "\n[route]\ntopic = \"outbox-event-${routedByValue}.fifo\"\n";

fn queue_of(kind: &str) -> String {
    format!("outbox-event-{kind}.fifo")
}

/// Messages read from the queue of `kind`, as the Kafka checks read records (topic
/// `outbox.event.<kind>`).
fn consumed(kind: &str, got: &[Got]) -> Vec<Consumed> {
    got.iter()
        .enumerate()
        .map(|(i, g)| g.as_consumed(&format!("outbox.event.{kind}"), i as i64))
        .collect()
}

fn servers() -> (Mysqld, Moto) {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let moto = Moto::start();
    for kind in ["order", "customer"] {
        moto.create_queue(&queue_of(kind), &[]);
    }
    (db, moto)
}

fn pipeline(name: &str, db: &Mysqld, moto: &Moto, extra: &str) -> Outboxd {
    pipeline_listening(name, db, moto, extra, "")
}

fn pipeline_listening(name: &str, db: &Mysqld, moto: &Moto, extra: &str, http: &str) -> Outboxd {
    let body = config_with_aws(&db.cdc_url(), "sqs", &moto.endpoint(), extra)
        .replace("listen = \"\"", &format!("listen = \"{http}\""));
    let mut outboxd = Outboxd::new(name, &format!("{body}{FIFO_ROUTE}"));
    outboxd.env = Moto::env();
    outboxd
}

fn text(out: std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Reads both FIFO queues (while outboxd sends: see [`Moto::take`]) until `total` distinct rows
/// came and the queues stayed empty for a second, or `READ_LIMIT` passed; all of them, as
/// records. Every message carries its key as group and its id as de-duplication id, and a
/// repeat of a row came within the 5 minutes in which SQS drops it by that id (moto does not).
fn read_all(moto: &Moto, total: usize) -> Vec<Consumed> {
    let (mut orders, mut customers) = (Vec::new(), Vec::new());
    let mut ids = std::collections::HashMap::new();
    let deadline = std::time::Instant::now() + READ_LIMIT * 2;
    let mut quiet_since = std::time::Instant::now();
    loop {
        let (o, c) = (
            moto.take(&queue_of("order")),
            moto.take(&queue_of("customer")),
        );
        if o.is_empty() && c.is_empty() {
            if ids.len() >= total && quiet_since.elapsed() > Duration::from_secs(1)
                || std::time::Instant::now() > deadline
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        quiet_since = std::time::Instant::now();
        for g in o.iter().chain(&c) {
            assert_eq!(
                g.group.as_deref(),
                g.attribute("outboxd.key").as_deref(),
                "group = key"
            );
            assert_eq!(
                g.dedup.as_deref(),
                g.attribute("id").as_deref(),
                "dedup id = row id"
            );
            let first = *ids.entry(g.dedup.clone()).or_insert(g.sent_ms);
            assert!(
                g.sent_ms.saturating_sub(first) < 300_000,
                "a repeat of {:?} came after SQS's 5-minute de-duplication window ({} ms after the first)",
                g.dedup,
                g.sent_ms.saturating_sub(first)
            );
        }
        orders.extend(o);
        customers.extend(c);
    }
    consumed("order", &orders)
        .into_iter()
        .chain(consumed("customer", &customers))
        .collect()
}

#[test]
fn rows_reach_fifo_queues_with_the_key_as_group_and_the_id_as_dedup_id_in_key_order() {
    let (db, moto) = servers();
    moto.create_queue("outboxd-dlq.fifo", &[]);
    moto.create_queue("outboxd-standard", &[]);
    let http = free_port();
    let mut outboxd = pipeline_listening(
        "sqs-e2e",
        &db,
        &moto,
        "dead_letter_topic = \"outboxd-dlq.fifo\"",
        &format!("127.0.0.1:{http}"),
    );
    // With every library's trace on, the secret key and session token are still never printed.
    let check = outboxd
        .command(&["check"])
        .env("RUST_LOG", "trace")
        .output()
        .unwrap();
    let ok = check.status.success();
    let shown = text(check);
    assert!(ok, "{shown}");
    for line in [
        format!(
            "PASS  sqs: credentials found; region eu-west-1, endpoint {}",
            moto.endpoint()
        ),
        "PASS  sqs dead-letter queue: \"outboxd-dlq.fifo\" is FIFO".to_string(),
        "one the router made has neither: its outboxd.row".to_string(),
    ] {
        assert!(shown.contains(&line), "{line} in\n{shown}");
    }
    assert!(
        !shown.contains(SECRET_KEY) && !shown.contains(SESSION_TOKEN),
        "{shown}"
    );
    // A standard dead-letter queue: check warns that order is best-effort there.
    let standard = pipeline(
        "sqs-standard",
        &db,
        &moto,
        "dead_letter_topic = \"outboxd-standard\"",
    );
    let shown = text(standard.command_output(&["check"]));
    assert!(
        shown.contains("WARN  sqs dead-letter queue: \"outboxd-standard\" is a standard queue"),
        "{shown}"
    );
    outboxd.start_with_env(&[], &[("RUST_LOG", "trace,hyper=info,h2=info")]);
    insert_rows(&db, 0, 300, 7);
    let records = read_all(&moto, 300);
    assert_eq!(records.len(), 300, "{}", outboxd.log());
    assert_eq!(check_records(&records, 0..300), 0, "no duplicates");
    check_per_key_order(&records);
    wait_until("the checkpoint to pass the last row", READ_LIMIT, || {
        outboxd.checkpoint_or_null()["position"]["gtid_set"]
            == db.sql_socket("SELECT @@gtid_binlog_pos;").trim()
    });
    let (_, metrics) = http_get(http, "/metrics");
    for line in [
        r#"outboxd_events_forwarded_total{pipeline="sqs-e2e",sink="sqs",topic="outbox-event-order.fifo"} 200"#,
        r#"outboxd_events_forwarded_total{pipeline="sqs-e2e",sink="sqs",topic="outbox-event-customer.fifo"} 100"#,
        r#"outboxd_inflight_events{pipeline="sqs-e2e",sink="sqs"} 0"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    // Several dead letters the router makes in one transaction: the FIFO dead-letter queue keeps
    // each, since its de-duplication id is the row (`outboxd.row`), not the transaction.
    insert_unroutable_rows(&db, 9990..9994);
    let dead = moto.read("outboxd-dlq.fifo", 4, READ_LIMIT);
    let ids: std::collections::BTreeSet<String> =
        dead.iter().filter_map(|m| m.dedup.clone()).collect();
    assert_eq!((dead.len(), ids.len()), (4, 4), "{ids:?} {}", outboxd.log());
    outboxd.stop();
    let log = outboxd.log();
    assert!(
        log.contains("aws_sigv4") || log.contains("canonical"),
        "trace was on"
    );
    assert!(
        !log.contains(SECRET_KEY) && !log.contains(SESSION_TOKEN),
        "secret in the log"
    );
}

#[test]
fn a_missing_queue_or_a_message_over_the_queues_size_is_dead_lettered_or_stops_outboxd() {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let moto = Moto::start();
    // Only orders have a queue, and it takes 2 KiB at most; customer rows have none.
    moto.create_queue(&queue_of("order"), &[("MaximumMessageSize", "2048")]);
    moto.create_queue("outboxd-dlq", &[]);
    let mut outboxd = pipeline("sqs-dlq", &db, &moto, "dead_letter_topic = \"outboxd-dlq\"");
    outboxd.start();
    insert_rows(&db, 0, 90, 9);
    db.sql_socket("INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES (UNHEX('00000000000000000000000000009999'), 'order', 'big', 'Created', CONCAT('\"', REPEAT('x', 3000), '\"'));");
    let orders = moto.read(&queue_of("order"), 60, READ_LIMIT);
    let parked = moto.read("outboxd-dlq", 31, READ_LIMIT);
    assert_eq!(orders.len(), 60, "{}", outboxd.log());
    assert_eq!(parked.len(), 31, "{}", outboxd.log());
    let unroutable = parked
        .iter()
        .filter(|g| {
            g.attribute("outboxd.reason").is_some_and(|r| {
                r.starts_with("unroutable: no queue named \"outbox-event-customer.fifo\"")
            })
        })
        .count();
    assert_eq!(unroutable, 30, "{parked:?}");
    let big = parked
        .iter()
        .find(|g| g.attribute("outboxd.key").as_deref() == Some("big"))
        .expect("the large row is parked");
    assert!(
        big.attribute("outboxd.reason")
            .unwrap()
            .starts_with("too_large:"),
        "{big:?}"
    );
    assert_eq!(big.attribute("outboxd.body").as_deref(), Some("omitted"));
    assert_eq!(big.body, "-");
    outboxd.stop();

    // Without a dead-letter queue: outboxd stops naming the queue, and the checkpoint stays
    // before the row (a restart stops on it again: nothing is skipped).
    let mut strict = pipeline("sqs-strict", &db, &moto, "");
    strict.start();
    insert_rows(&db, 90, 93, 1);
    let end = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    let status = strict.wait_exit(Duration::from_secs(60));
    let log = strict.log();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("no queue named \"outbox-event-customer.fifo\""),
        "{log}"
    );
    let stopped_at = strict.checkpoint()["position"]["gtid_set"].clone();
    assert_ne!(stopped_at, end.as_str(), "stopped before the row");
    let (ok, log) = crate::tls::output(&strict, &["run", "--skip-checks"]);
    assert!(!ok && log.contains("no queue named"), "{log}");
    assert_eq!(strict.checkpoint()["position"]["gtid_set"], stopped_at);
}

/// The faults a lane meets, injected together (moto produces none of them): one batch in five
/// cut short after 3 entries (the rest reported failed, as SQS does under load), one in ten
/// throttled whole, one in ten with only its first entry failed and the rest stored.
const BATCH_FAULTS: &str =
    "aws_batch_partial=20%return(3);aws_batch_throttle=10%return;aws_batch_entry_fails=10%return(InternalError);aws_batch_reply_lost=10%return";

/// `total` rows from several writers into the SQS or SNS (`section`) pipeline `outboxd`, which
/// meets [`BATCH_FAULTS`] and `kills` kill -9s; every row read back from the FIFO queues in
/// per-key order, each repeat inside the de-duplication window. Returns the messages read.
fn rows_survive_batch_faults_and_kills(
    db: &Mysqld,
    moto: &Moto,
    section: &str,
    total: u64,
    kills: usize,
) -> Vec<Consumed> {
    // A checkpoint written once a second: each kill leaves up to a second of stored rows behind
    // it, which the next start sends again (the FIFO queue must drop every one).
    let mut outboxd = Outboxd::with_checkpoint(
        &format!("{section}-faults"),
        &format!(
            "{}{FIFO_ROUTE}",
            config_with_aws(
                &db.cdc_url(),
                section,
                &moto.endpoint(),
                "message_timeout_ms = 20000"
            )
        ),
        "interval_ms = 1000",
    );
    outboxd.env = Moto::env();
    outboxd.env.push(("FAILPOINTS".into(), BATCH_FAULTS.into()));
    outboxd.start();
    let records = std::thread::scope(|scope| {
        let reader = scope.spawn(|| read_all(moto, total as usize));
        let writer = spawn_writer(db.socket_path(), total, &[1, 9, 40], 1);
        kill_9_and_restart(&mut outboxd, kills);
        writer.join().unwrap();
        let end = db
            .sql_socket("SELECT @@gtid_binlog_pos;")
            .trim()
            .to_string();
        wait_until(
            "the checkpoint to reach the end of the binlog",
            Duration::from_secs(180),
            || outboxd.checkpoint_or_null()["position"]["gtid_set"] == end.as_str(),
        );
        reader.join().unwrap()
    });
    let resends = check_records(&records, 0..total);
    // Each repeat carries its row's id as de-duplication id and came within 5 minutes of the
    // first (read_all checks both): SQS drops every one; moto keeps none of deleted messages.
    println!(
        "{section}: {} messages for {total} rows after {kills} kill -9 of outboxd, partial batches, single-entry failures and throttling: {resends} resends, each inside the de-duplication window",
        records.len()
    );
    check_per_key_order(&records);
    // Batches that were stored and then answered as failed went again, as new sends.
    assert!(
        outboxd.log().contains("aws_batch_reply_lost"),
        "the lost-reply fail point fired"
    );
    outboxd.stop();
    records
}

#[test]
fn partial_batch_failures_throttling_and_kill_9s_lose_nothing_and_keep_each_keys_order() {
    let (db, moto) = servers();
    // moto's FIFO queues slow down with every message they hold: a load it can keep up with.
    rows_survive_batch_faults_and_kills(&db, &moto, "sqs", 600, 5);
}

#[test]
fn sns_fifo_topics_lose_nothing_and_keep_each_keys_order_across_batch_faults_and_kill_9s() {
    // Each FIFO topic fans out to the FIFO queue of the same name, which the test reads.
    let (db, moto) = servers();
    for kind in ["order", "customer"] {
        let arn = moto.create_topic(&queue_of(kind));
        let url = moto.create_queue(&queue_of(kind), &[]);
        moto.subscribe(&arn, &url);
    }
    rows_survive_batch_faults_and_kills(&db, &moto, "sns", 400, 3);
}

/// Commits rows `0..total` of kind `order` over `keys` keys (`hot-0`, `hot-1`, …) in
/// transactions of `per_txn`, while reading the queues; returns what was read, once every row
/// arrived.
fn hot_rows(
    db: &Mysqld,
    moto: &Moto,
    outboxd: &Outboxd,
    total: u64,
    per_txn: u64,
    keys: u64,
) -> Vec<Consumed> {
    let records = std::thread::scope(|scope| {
        let reader = scope.spawn(|| read_all(moto, total as usize));
        db.sql_socket(&transactions(0, total, per_txn, |n| {
            let (id, _, _, payload) = crate::rig::scenario::event(n);
            format!(
                "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES (UNHEX('{id}'), 'order', 'hot-{}', 'Created', '{payload}');",
                n % keys
            )
        }));
        reader.join().unwrap()
    });
    let distinct: std::collections::BTreeSet<u64> = records.iter().map(n_of).collect();
    assert_eq!(
        distinct,
        (0..total).collect(),
        "every row arrives; outboxd's log:\n{}",
        outboxd.log()
    );
    records
}

/// A reply that fails a batch's first entry and stores the ones after it (SQS does so under
/// load) must not put a group's later message ahead of its earlier one; so a FIFO batch holds
/// at most one message per group. Two keys, so that a batch could hold many of each.
#[test]
fn a_reply_failing_only_the_first_entry_of_a_batch_reorders_no_fifo_group() {
    let (db, moto) = servers();
    let mut outboxd = pipeline("sqs-first-fails", &db, &moto, "");
    outboxd.env.push((
        "FAILPOINTS".into(),
        "aws_batch_entry_fails=25%return(InternalError)".into(),
    ));
    outboxd.start();
    let records = hot_rows(&db, &moto, &outboxd, 200, 50, 2);
    assert!(
        outboxd.log().contains("entries of a batch go again"),
        "the fail point fired"
    );
    check_per_key_order(&records);
    outboxd.stop();
}

/// One hot key on a FIFO queue goes one round trip at a time (a batch holds one message per
/// group), so a backlog of it waits in the lane far longer than `message_timeout_ms`. The timeout
/// counts from a message's first send, not from when it joined the lane: waiting its turn ends
/// no session (before, each session ended after a second and sent its rows again).
#[test]
fn a_backlog_of_one_hot_fifo_group_waits_its_turn_without_ending_the_session() {
    let (db, moto) = servers();
    let mut outboxd = pipeline("sqs-hot", &db, &moto, "message_timeout_ms = 1000");
    outboxd.start();
    let total = 400;
    let records = hot_rows(&db, &moto, &outboxd, total, 100, 1);
    check_per_key_order(&records);
    let log = outboxd.log();
    assert!(
        !log.contains("session ended"),
        "a message waiting its turn ended the session:\n{log}"
    );
    assert_eq!(records.len(), total as usize, "nothing was sent twice");
    outboxd.stop();
}

/// An entry refused for a reason every message would meet (a KMS key, a grant) stops outboxd
/// instead of dead-lettering all traffic; a refusal of one message's own (an invalid value)
/// dead-letters that message with its reason.
#[test]
fn an_entry_refused_by_kms_stops_outboxd_while_an_invalid_entry_is_dead_lettered() {
    let (db, moto) = servers();
    moto.create_queue("outboxd-dlq", &[]);
    let mut outboxd = pipeline(
        "sqs-refused",
        &db,
        &moto,
        "dead_letter_topic = \"outboxd-dlq\"",
    );
    let with_failpoint = |outboxd: &mut Outboxd, failpoints: &str| {
        outboxd.env.retain(|(k, _)| k != "FAILPOINTS");
        if !failpoints.is_empty() {
            outboxd.env.push(("FAILPOINTS".into(), failpoints.into()));
        }
    };
    // One entry refused as invalid: parked with its reason, the rest delivered.
    with_failpoint(
        &mut outboxd,
        "aws_batch_entry_fails=1*return(InvalidParameterValue)",
    );
    outboxd.start();
    let delivered = std::thread::scope(|scope| {
        let reader = scope.spawn(|| read_all(&moto, 19));
        insert_rows(&db, 0, 20, 20);
        reader.join().unwrap()
    });
    let parked = moto.read("outboxd-dlq", 1, READ_LIMIT);
    assert_eq!(parked.len(), 1, "{}", outboxd.log());
    assert!(
        parked[0]
            .attribute("outboxd.reason")
            .is_some_and(|r| r.starts_with("refused: InvalidParameterValue")),
        "{parked:?}"
    );
    let parked_n = n_of(&parked[0].as_consumed("outbox.event.order", 0));
    let mut all: Vec<u64> = delivered.iter().map(n_of).collect();
    assert!(!all.contains(&parked_n), "the parked row is not delivered");
    all.push(parked_n);
    all.sort();
    all.dedup();
    assert_eq!(all, (0..20).collect::<Vec<_>>());
    let first = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    wait_until("the first rows checkpointed", READ_LIMIT, || {
        outboxd.checkpoint_or_null()["position"]["gtid_set"] == first.as_str()
    });
    outboxd.stop();

    // Every entry refused by KMS: outboxd stops naming the code and what to grant, parks
    // nothing, and keeps its checkpoint before the rows.
    with_failpoint(
        &mut outboxd,
        "aws_batch_entry_fails=return(KMS.DisabledException)",
    );
    outboxd.start();
    insert_rows(&db, 20, 30, 10);
    let status = outboxd.wait_exit(Duration::from_secs(60));
    let log = outboxd.log();
    assert!(!status.success(), "{log}");
    assert!(log.contains("KMS.DisabledException"), "{log}");
    assert!(
        !log.contains("sent to the dead-letter destination"),
        "a refusal every message meets parks none: {log}"
    );
    assert!(log.contains("a KMS key they may use"), "{log}");
    assert_eq!(outboxd.checkpoint()["position"]["gtid_set"], first.as_str());
    assert!(moto.take("outboxd-dlq").is_empty(), "nothing parked");

    // Once the key is usable again, the rows arrive.
    with_failpoint(&mut outboxd, "");
    outboxd.start();
    let rest = read_all(&moto, 10);
    // (A late repeat of an earlier row may come too: moto drops repeats only while the first
    // copy is still in the queue.)
    let mut ns: Vec<u64> = rest.iter().map(n_of).filter(|n| *n >= 20).collect();
    ns.sort();
    ns.dedup();
    assert_eq!(ns, (20..30).collect::<Vec<_>>());
    outboxd.stop();
}

#[test]
fn a_frozen_endpoint_past_the_message_timeout_resumes_without_losing_a_row() {
    let (db, moto) = servers();
    let mut outboxd = pipeline("sqs-frozen", &db, &moto, "message_timeout_ms = 2000");
    outboxd.start();
    let all = std::thread::scope(|scope| {
        let reader = scope.spawn(|| read_all(&moto, 300));
        insert_rows(&db, 0, 100, 5);
        let first = db
            .sql_socket("SELECT @@gtid_binlog_pos;")
            .trim()
            .to_string();
        wait_until("the first rows checkpointed", READ_LIMIT, || {
            outboxd.checkpoint_or_null()["position"]["gtid_set"] == first.as_str()
        });
        moto.freeze();
        let frozen = std::time::Instant::now();
        insert_rows(&db, 100, 300, 5);
        // The endpoint stays down for 30 s: the session ends on the delivery timeout, and the
        // next ones try again while it is down.
        wait_until(
            "the delivery timeout to end a session",
            Duration::from_secs(60),
            || outboxd.log().contains("still not stored"),
        );
        wait_until("30 s of outage", Duration::from_secs(60), || {
            frozen.elapsed() >= Duration::from_secs(30)
        });
        assert!(outboxd.child_running(), "an outage stops nothing");
        moto.thaw();
        reader.join().unwrap()
    });
    check_records(&all, 0..300);
    check_per_key_order(&all);
    outboxd.stop();
}

#[test]
fn postgres_rows_reach_sqs_fifo_queues_in_key_order_across_kill_9s_each_resend_inside_the_dedup_window(
) {
    use crate::postgres_pipeline::{insert_rows as pg_insert, pg_payload, SCHEMA as PG_SCHEMA};
    use crate::rig::scenario::check_records_by;
    let pg = crate::rig::Postgres::start(&[]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql("app", PG_SCHEMA);
    let moto = Moto::start();
    for kind in ["order", "customer"] {
        moto.create_queue(&queue_of(kind), &[]);
    }
    let body = format!(
        "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\nslot = \"outboxd_sqs\"\n\
         publication = \"outboxd_sqs\"\nheartbeat_interval_ms = 1000\n\
         [sqs]\nregion = \"eu-west-1\"\nendpoint_url = \"{}\"\n[http]\nlisten = \"\"\n{FIFO_ROUTE}",
        pg.url("cdc", "app"),
        moto.endpoint()
    );
    let mut outboxd = Outboxd::new("sqs-pg", &body);
    outboxd.env = Moto::env();
    outboxd.start();
    let total = 500u64;
    let records = std::thread::scope(|scope| {
        let reader = scope.spawn(|| read_all(&moto, total as usize));
        scope.spawn(|| {
            for from in (0..total).step_by(25) {
                pg_insert(&pg, from, from + 25, 5);
            }
        });
        kill_9_and_restart(&mut outboxd, 2);
        reader.join().unwrap()
    });
    let resends = check_records_by(&records, 0..total, pg_payload);
    println!(
        "sqs from postgres: {} messages for {total} rows after 2 kill -9: {resends} resends, each inside SQS's de-duplication window",
        records.len()
    );
    check_per_key_order(&records);
    outboxd.stop();
}

#[test]
fn rows_reach_sns_fifo_topics_in_key_order_and_a_missing_topic_is_dead_lettered() {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let moto = Moto::start();
    // Orders have a FIFO topic, read through a FIFO queue subscribed to it; customers none.
    let arn = moto.create_topic("outbox-event-order.fifo");
    let queue = moto.create_queue("order-reader.fifo", &[]);
    moto.subscribe(&arn, &queue);
    let dlq_arn = moto.create_topic("outboxd-dlq");
    let parked = moto.create_queue("parked", &[]);
    moto.subscribe(&dlq_arn, &parked);
    let sns_pipeline = |name: &str, dead_letters: &str| {
        let mut outboxd = Outboxd::new(
            name,
            &format!(
                "{}{FIFO_ROUTE}",
                config_with_aws(
                    &db.cdc_url(),
                    "sns",
                    &moto.endpoint(),
                    &format!("dead_letter_topic = \"{dead_letters}\"")
                )
            ),
        );
        outboxd.env = Moto::env();
        outboxd
    };
    let mut outboxd = sns_pipeline("sns-e2e", "outboxd-dlq");
    let shown = text(outboxd.command_output(&["check"]));
    assert!(
        shown.contains("WARN  sns dead-letter topic: \"outboxd-dlq\" is a standard topic"),
        "{shown}"
    );
    // A topic nobody subscribed to takes every message and delivers it nowhere: check says so.
    moto.create_topic("outboxd-unheard");
    let unheard = sns_pipeline("sns-unheard", "outboxd-unheard");
    let warned = text(unheard.command_output(&["check"]));
    assert!(
        warned.contains("WARN  sns dead-letter topic: \"outboxd-unheard\"")
            && warned.contains("has no confirmed subscription"),
        "{warned}"
    );
    assert!(!shown.contains("no confirmed subscription"), "{shown}");
    outboxd.start();
    insert_rows(&db, 0, 150, 5);
    let orders = moto.read("order-reader.fifo", 100, READ_LIMIT);
    let dead = moto.read("parked", 50, READ_LIMIT);
    assert_eq!(orders.len(), 100, "{}", outboxd.log());
    assert_eq!(dead.len(), 50, "{}", outboxd.log());
    for g in &orders {
        assert_eq!(
            g.group.as_deref(),
            g.attribute("outboxd.key").as_deref(),
            "group = key"
        );
    }
    let records = consumed("order", &orders);
    let duplicates = check_records(&records, 0..0);
    assert_eq!(duplicates, 0);
    check_per_key_order(&records);
    assert!(dead
        .iter()
        .all(|g| g.attribute("outboxd.reason").is_some_and(
            |r| r.starts_with("unroutable: no topic named \"outbox-event-customer.fifo\"")
        )));
    outboxd.stop();
}
