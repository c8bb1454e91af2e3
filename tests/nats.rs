//! The NATS JetStream sink end to end, on a private nats-server (Debian's, `-js`) and MariaDB:
//! every row stored with its id as `Nats-Msg-Id`, its key and headers, in per-key order; a subject
//! no stream captures dead-lettered or stopping outboxd (never counted as delivered); kill -9 of
//! outboxd and of the server under load lose nothing, and the stream drops the resends.

use std::time::Duration;

use crate::rig::nats::{config_with_nats, Auth, Got, Nats};
use crate::rig::scenario::{
    check_per_key_order, check_records, insert_rows, insert_unroutable_rows, kill_9_and_restart,
    spawn_writer, uuid_of, SCHEMA,
};
use crate::rig::{free_port, http_get, wait_until, Consumed, Mysqld, Outboxd};

const READ_LIMIT: Duration = Duration::from_secs(90);

/// MariaDB with the outbox schema and a NATS server whose stream EVENTS captures both aggregate
/// types' subjects.
fn servers() -> (Mysqld, Nats) {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let nats = Nats::start();
    nats.add_stream("EVENTS", &["outbox.event.order", "outbox.event.customer"]);
    (db, nats)
}

fn consumed(got: &[Got]) -> Vec<Consumed> {
    got.iter()
        .enumerate()
        .map(|(i, g)| g.as_consumed(i as i64))
        .collect()
}

fn text(out: std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn rows_reach_jetstream_acked_with_their_ids_as_msg_ids_keys_and_headers_in_key_order() {
    let (db, nats) = servers();
    nats.add_stream("PARKED", &["outboxd.dlq"]);
    let http = free_port();
    let mut outboxd = Outboxd::new(
        "nats-e2e",
        &config_with_nats(
            &db.cdc_url(),
            &nats.url(),
            "dead_letter_topic = \"outboxd.dlq\"",
        )
        .replace("listen = \"\"", &format!("listen = \"127.0.0.1:{http}\"")),
    );
    let check = outboxd.command_output(&["check"]);
    let ok = check.status.success();
    let shown = text(check);
    assert!(ok, "{shown}");
    for line in [
        "PASS  nats: connected to nats://127.0.0.1",
        "PASS  nats jetstream: enabled",
        "PASS  nats dead-letter subject: \"outboxd.dlq\" is captured by stream \"PARKED\"",
    ] {
        assert!(shown.contains(line), "{line} in\n{shown}");
    }
    // A dead-letter stream whose duplicate window is shorter than the delivery timeout: a resend
    // after a timeout could be stored twice, and check says so.
    nats.add_stream_with_window("SHORT", &["outboxd.short"], Duration::from_secs(2));
    let short = Outboxd::new(
        "nats-short",
        &config_with_nats(
            &db.cdc_url(),
            &nats.url(),
            "dead_letter_topic = \"outboxd.short\"",
        ),
    );
    let shown = text(short.command_output(&["check"]));
    assert!(
        shown.contains("WARN  nats dead-letter subject: \"outboxd.short\" is captured by stream \"SHORT\", whose duplicate window (2s) is shorter"),
        "{shown}"
    );
    outboxd.start();
    insert_rows(&db, 0, 300, 7);
    let got = nats.read("EVENTS", 300, READ_LIMIT);
    assert_eq!(got.len(), 300, "{}", outboxd.log());
    for g in &got {
        assert_eq!(
            g.header("Nats-Msg-Id"),
            g.header("id"),
            "Nats-Msg-Id = row id"
        );
        assert!(g.header("outboxd.timestamp").is_some());
    }
    let records = consumed(&got);
    assert_eq!(check_records(&records, 0..300), 0, "no duplicates");
    check_per_key_order(&records);
    wait_until("the checkpoint to pass the last row", READ_LIMIT, || {
        outboxd.checkpoint_or_null()["position"]["gtid_set"]
            == db.sql_socket("SELECT @@gtid_binlog_pos;").trim()
    });
    let (_, metrics) = http_get(http, "/metrics");
    for line in [
        r#"outboxd_events_forwarded_total{pipeline="nats-e2e",sink="nats",topic="outbox.event.order"} 200"#,
        r#"outboxd_events_forwarded_total{pipeline="nats-e2e",sink="nats",topic="outbox.event.customer"} 100"#,
        r#"outboxd_inflight_events{pipeline="nats-e2e",sink="nats"} 0"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    outboxd.stop();
}

#[test]
fn a_subject_no_stream_captures_is_dead_lettered_and_without_a_dead_letter_subject_outboxd_stops() {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let nats = Nats::start();
    // Only orders are captured: customer rows (every third) have no stream.
    nats.add_stream("ORDERS", &["outbox.event.order"]);
    nats.add_stream("PARKED", &["outboxd.dlq"]);
    let mut outboxd = Outboxd::new(
        "nats-dlq",
        &config_with_nats(
            &db.cdc_url(),
            &nats.url(),
            "dead_letter_topic = \"outboxd.dlq\"",
        ),
    );
    outboxd.start();
    insert_rows(&db, 0, 900, 9);
    let orders = nats.read("ORDERS", 600, READ_LIMIT);
    let parked = nats.read("PARKED", 300, READ_LIMIT);
    assert_eq!(orders.len(), 600, "{}", outboxd.log());
    assert_eq!(parked.len(), 300, "{}", outboxd.log());
    // A routing value that makes a valid Kafka topic but no NATS subject (an empty token).
    db.sql_socket("INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES (UNHEX('00000000000000000000000000009999'), 'a..b', 'k', 'Created', '{}');");
    let invalid = nats.read("PARKED", 301, READ_LIMIT);
    assert_eq!(invalid.len(), 301, "{}", outboxd.log());
    let last = invalid.last().unwrap();
    assert!(
        last.header("outboxd.error")
            .unwrap()
            .starts_with("invalid_topic: "),
        "{:?}",
        last.header("outboxd.error")
    );
    assert_eq!(
        last.header("outboxd.subject").as_deref(),
        Some("outbox.event.a..b")
    );
    assert_eq!(last.payload, b"{}");
    assert!(
        !outboxd.log().contains("session ended"),
        "{}",
        outboxd.log()
    );
    for p in &parked {
        let n = u64::from_str_radix(&p.header("id").unwrap().replace('-', ""), 16).unwrap();
        assert_eq!(n % 3, 0, "only customer rows are unroutable");
        assert_eq!(p.header("id").unwrap(), uuid_of(n));
        assert_eq!(
            p.header("outboxd.subject").as_deref(),
            Some("outbox.event.customer")
        );
        assert!(p
            .header("outboxd.error")
            .unwrap()
            .starts_with("unroutable: "));
    }
    check_per_key_order(&consumed(&orders));

    // Several dead letters the router makes in one transaction: each is a message of its own,
    // named by its row (`outboxd.row`: the transaction's position and the row's place in it, the
    // same on every resend), so a resend of the transaction repeats none of them.
    let gtid = || {
        db.sql_socket("SELECT @@gtid_binlog_pos;")
            .trim()
            .to_string()
    };
    let before_batch = gtid();
    insert_unroutable_rows(&db, 9990..9994);
    let batch = nats.read("PARKED", 305, READ_LIMIT);
    assert_eq!(batch.len(), 305, "{}", outboxd.log());
    let rows: std::collections::BTreeSet<String> = batch[301..]
        .iter()
        .map(|m| m.header("outboxd.row").unwrap())
        .collect();
    assert_eq!(rows.len(), 4, "{rows:?}");
    wait_until("the checkpoint to pass the batch", READ_LIMIT, || {
        outboxd.checkpoint_or_null()["position"]["gtid_set"] == gtid().as_str()
    });
    outboxd.stop();
    let set = outboxd.command_output(&["checkpoint", "set", &format!("gtid:{before_batch}")]);
    assert!(set.status.success(), "{}", text(set));
    outboxd.start();
    insert_unroutable_rows(&db, 9994..9995);
    let again = nats.read("PARKED", 306, READ_LIMIT);
    assert_eq!(
        again.len(),
        306,
        "the resent dead letters are dropped as repeats: {}",
        outboxd.log()
    );
    assert!(!rows.contains(&again[305].header("outboxd.row").unwrap()));
    outboxd.stop();

    // With nowhere to park them: outboxd exits naming the subject and the remedy, and keeps its
    // checkpoint before the row.
    let mut strict = Outboxd::new(
        "nats-strict",
        &config_with_nats(&db.cdc_url(), &nats.url(), ""),
    );
    strict.start();
    let before = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    // Row 900 is a customer row, first in its transaction.
    insert_rows(&db, 900, 909, 9);
    let status = strict.wait_exit(Duration::from_secs(60));
    assert!(!status.success());
    let log = strict.log();
    assert!(
        log.contains("no stream captures subject \"outbox.event.customer\""),
        "{log}"
    );
    assert!(log.contains("nats stream add"), "{log}");
    assert!(log.contains("set nats.dead_letter_topic"), "{log}");
    assert!(!log.contains("café"), "no row data in the log: {log}");
    assert_eq!(
        strict.checkpoint()["position"]["gtid_set"],
        before.as_str(),
        "{log}"
    );
    // A restart stops again on the same row: nothing was skipped.
    // (Run to its exit: it may stop before a start could see the stream open.)
    let (ok, log) = crate::tls::output(&strict, &["run", "--skip-checks"]);
    assert!(!ok && log.contains("no stream captures"), "{log}");
    assert_eq!(strict.checkpoint()["position"]["gtid_set"], before.as_str());
}

#[test]
fn kill_9_of_outboxd_and_of_nats_under_load_loses_nothing_and_the_stream_drops_every_resend() {
    let (db, mut nats) = servers();
    // A checkpoint written once a second: each kill leaves up to a second of acknowledged rows
    // behind it, which the next start publishes again (the stream must drop every one).
    let mut outboxd = Outboxd::with_checkpoint(
        "nats-kill",
        &config_with_nats(&db.cdc_url(), &nats.url(), "message_timeout_ms = 10000"),
        "interval_ms = 1000",
    );
    outboxd.start();
    let total = 6_000u64;
    // One transaction per client call: the load lasts through the kills.
    let writer = spawn_writer(db.socket_path(), total, &[1, 9, 40], 1);
    kill_9_and_restart(&mut outboxd, 5);
    // The server dies under load and comes back (same store): what it acknowledged is kept, what
    // it did not is published again from the checkpoint.
    nats.kill9();
    nats.boot();
    writer.join().unwrap();
    let end = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    let start = std::time::Instant::now();
    while outboxd.checkpoint_or_null()["position"]["gtid_set"] != end.as_str() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the checkpoint did not reach the end; outboxd's log:\n{}",
            outboxd.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let got = nats.read("EVENTS", total as usize, READ_LIMIT);
    let records = consumed(&got);
    let duplicates = check_records(&records, 0..total);
    println!(
        "nats: {} messages for {total} rows after 5 kill -9 of outboxd and one of nats-server: {duplicates} duplicates",
        records.len()
    );
    // Every resend came inside the stream's duplicate window with the row's id.
    assert_eq!(duplicates, 0, "the stream keeps each row once");
    check_per_key_order(&records);
    outboxd.stop();
}

#[test]
fn a_frozen_nats_past_the_delivery_timeout_and_a_sigterm_while_it_is_frozen_lose_nothing() {
    let (db, nats) = servers();
    let mut outboxd = Outboxd::new(
        "nats-frozen",
        &config_with_nats(
            &db.cdc_url(),
            &nats.url(),
            "message_timeout_ms = 3000\ndrain_timeout_ms = 2000",
        ),
    );
    outboxd.start();
    nats.freeze();
    insert_rows(&db, 0, 300, 10);
    wait_until("a delivery timeout", READ_LIMIT, || {
        let log = outboxd.log();
        log.contains("for the broker's acknowledgement") || log.contains("no PubAck")
    });
    nats.thaw();
    // SIGTERM while the server is frozen: the exit is bounded by drain_timeout_ms, and what was
    // not acknowledged is published again by the next start.
    nats.freeze();
    insert_rows(&db, 300, 400, 10);
    nix::sys::signal::kill(outboxd.pid(), nix::sys::signal::Signal::SIGTERM).unwrap();
    outboxd.wait_exit(Duration::from_secs(30));
    nats.thaw();
    outboxd.start();
    let got = nats.read("EVENTS", 400, READ_LIMIT);
    let records = consumed(&got);
    let duplicates = check_records(&records, 0..400);
    println!(
        "nats frozen: {} messages for 400 rows, {duplicates} duplicates",
        records.len()
    );
    assert!(
        !nats.log().contains("panic"),
        "the server survived its freezes"
    );
    assert_eq!(duplicates, 0, "the stream keeps each row once");
    check_per_key_order(&records);
    outboxd.stop();
}

#[test]
fn check_names_what_each_streams_settings_cost_and_fails_the_ones_that_lose_acked_rows() {
    use async_nats::jetstream::stream::{Config, DiscardPolicy, RetentionPolicy, StorageType};
    let (db, nats) = servers();
    let stream = |name: &str, subject: &str| Config {
        name: name.into(),
        subjects: vec![subject.into()],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    };
    nats.add_stream_config(Config {
        storage: StorageType::Memory,
        ..stream("MEM", "mem.events")
    });
    nats.add_stream_config(Config {
        retention: RetentionPolicy::Interest,
        ..stream("HEARD", "interest.dlq")
    });
    nats.add_stream_config(Config {
        no_ack: true,
        ..stream("NOACK", "noack.events")
    });
    nats.add_stream_config(Config {
        discard: DiscardPolicy::Old,
        max_age: Duration::from_secs(3600),
        ..stream("AGED", "aged.dlq")
    });
    let check = |name: &str, topic: &str, extra: &str| {
        let config = format!(
            "{}\n[route]\ntopic = \"{topic}\"\n",
            config_with_nats(&db.cdc_url(), &nats.url(), extra)
        );
        let out = Outboxd::new(name, &config).command_output(&["check"]);
        (out.status.success(), text(out))
    };
    // Memory storage and interest retention without a consumer lose what the stream acknowledged:
    // check fails naming each, so `run` does not start.
    let (ok, shown) = check(
        "nats-lossy",
        "mem.events",
        "dead_letter_topic = \"interest.dlq\"",
    );
    assert!(!ok, "{shown}");
    for line in [
        "FAIL  nats subject: \"mem.events\" is captured by stream \"MEM\": it keeps messages in memory",
        "FAIL  nats dead-letter subject: \"interest.dlq\" is captured by stream \"HEARD\": its retention is interest and it has no consumer",
        "or set nats.allow_lossy_streams = true",
    ] {
        assert!(shown.contains(line), "{line} in\n{shown}");
    }
    // Accepted explicitly, they are warnings.
    let (ok, shown) = check(
        "nats-accepted",
        "mem.events",
        "dead_letter_topic = \"interest.dlq\"\nallow_lossy_streams = true",
    );
    assert!(ok, "{shown}");
    assert!(
        shown.contains("WARN  nats subject: \"mem.events\""),
        "{shown}"
    );
    // A stream that never acknowledges fails whatever is accepted; one that ages messages out warns.
    let (ok, shown) = check(
        "nats-noack",
        "noack.events",
        "dead_letter_topic = \"aged.dlq\"\nallow_lossy_streams = true",
    );
    assert!(!ok, "{shown}");
    for line in [
        "FAIL  nats subject: \"noack.events\" is captured by stream \"NOACK\": it has no_ack set",
        "WARN  nats dead-letter subject: \"aged.dlq\" is captured by stream \"AGED\": at its limits (max_age 3600s) it discards its oldest messages",
    ] {
        assert!(shown.contains(line), "{line} in\n{shown}");
    }
    // A templated route.topic: check cannot know the subject, so `run` judges the stream before
    // its first record there, and stops without publishing into it.
    let mut run = Outboxd::new(
        "nats-lossy-run",
        &format!(
            "{}\n[route]\ntopic = \"mem.${{routedByValue}}\"\n",
            config_with_nats(&db.cdc_url(), &nats.url(), "")
        ),
    );
    run.start();
    db.sql_socket("INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES (UNHEX('00000000000000000000000000000001'), 'events', 'k', 'Created', '{}');");
    let status = run.wait_exit(Duration::from_secs(60));
    let log = run.log();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains(
            "subject \"mem.events\" is captured by stream \"MEM\", and it keeps messages in memory"
        ) && log.contains("nats.allow_lossy_streams"),
        "{log}"
    );
    assert!(
        nats.read("MEM", 0, Duration::ZERO).is_empty(),
        "nothing was published there"
    );
}

#[test]
fn nats_credentials_are_never_printed_and_a_refused_login_stops_without_looping() {
    const PASSWORD: &str = "planted-nats-pw-91";
    const WRONG: &str = "planted-nats-wrong-92";
    const TOKEN: &str = "planted-nats-token-93";
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let nats = Nats::start_with(Auth::User("outboxd".into(), PASSWORD.into()), "", None);
    nats.add_stream("EVENTS", &["outbox.event.>"]);
    let no_secret = |what: &str, text: &str| {
        for secret in [PASSWORD, WRONG, TOKEN] {
            assert!(!text.contains(secret), "{what} printed {secret}:\n{text}");
        }
    };
    // A wrong password in the URL: check FAILs naming the login, run exits.
    let wrong = nats.url().replace(PASSWORD, WRONG);
    let outboxd = Outboxd::new("nats-secrets", &config_with_nats(&db.cdc_url(), &wrong, ""));
    let check = text(outboxd.command_output(&["check"]));
    assert!(
        check.contains("FAIL  nats: NATS at nats://outboxd:***@127.0.0.1"),
        "{check}"
    );
    assert!(check.contains("refused the login"), "{check}");
    no_secret("check", &check);
    let (ok, log) = crate::tls::output(&outboxd, &["run", "--skip-checks"]);
    assert!(!ok, "{log}");
    assert!(log.contains("refused the login"), "{log}");
    no_secret("run", &log);
    // A token where a user is wanted, from the environment: refused, never printed.
    let outboxd = Outboxd::new(
        "nats-token",
        &config_with_nats(
            &db.cdc_url(),
            &format!("nats://127.0.0.1:{}", nats.port),
            "",
        ),
    );
    let check = text(
        outboxd
            .command(&["check"])
            .env("OUTBOXD_NATS__TOKEN", TOKEN)
            .env("RUST_LOG", "debug")
            .output()
            .unwrap(),
    );
    assert!(check.contains("refused the login"), "{check}");
    no_secret("check with a token", &check);
    // The right password through the environment, with the client's own logging on.
    let mut outboxd = Outboxd::new(
        "nats-secrets-env",
        &config_with_nats(&db.cdc_url(), "nats://placeholder:4222", ""),
    );
    let env = [
        ("OUTBOXD_NATS__URL", nats.url()),
        ("RUST_LOG", "debug".into()),
    ];
    let check = text(
        outboxd
            .command(&["check"])
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .unwrap(),
    );
    assert!(check.contains("PASS  nats jetstream"), "{check}");
    no_secret("check with the URL from the environment", &check);
    outboxd.start_with_env(
        &[],
        &[("OUTBOXD_NATS__URL", &nats.url()), ("RUST_LOG", "debug")],
    );
    insert_rows(&db, 0, 3, 1);
    assert_eq!(nats.read("EVENTS", 3, READ_LIMIT).len(), 3);
    outboxd.stop();
    no_secret("run with debug logging", &outboxd.log());
}

#[test]
fn tls_verifies_the_servers_certificate_against_the_ca_file_and_refuses_a_wrong_ca() {
    use crate::rig::certs::{Ca, VALID};
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "outboxd test CA", "ca");
    let other_ca = Ca::new(dir.path(), "some other CA", "other-ca");
    let server = ca.server(dir.path(), "server", &["127.0.0.1"], VALID);
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let nats = Nats::start_with(
        Auth::Token("tls-token-1".into()),
        "",
        Some((&ca.pem, &server)),
    );
    nats.add_stream("EVENTS", &["outbox.event.>"]);
    let pipeline = |name: &str, trusted: &std::path::Path| {
        Outboxd::new(
            name,
            &config_with_nats(
                &db.cdc_url(),
                &nats.url(),
                &format!("ca_file = \"{}\"", trusted.display()),
            ),
        )
    };
    let mut outboxd = pipeline("nats-tls", &ca.pem);
    let (ok, shown) = crate::tls::output(&outboxd, &["check"]);
    assert!(
        ok && shown.contains("PASS  nats: connected to tls://***@127.0.0.1"),
        "{shown}"
    );
    assert!(
        !shown.contains("tls-token-1"),
        "a token in the URL is a secret: {shown}"
    );
    outboxd.start();
    insert_rows(&db, 0, 5, 1);
    assert_eq!(nats.read("EVENTS", 5, READ_LIMIT).len(), 5);
    outboxd.stop();
    let outboxd = pipeline("nats-tls-ca", &other_ca.pem);
    let (ok, shown) = crate::tls::output(&outboxd, &["check"]);
    assert!(!ok && shown.contains("FAIL  nats: TLS to NATS"), "{shown}");
    let (ok, log) = crate::tls::output(&outboxd, &["run", "--skip-checks"]);
    assert!(!ok && log.contains("TLS to NATS"), "{log}");
    assert!(!log.contains("tls-token-1"), "{log}");
}

#[test]
fn postgres_rows_reach_nats_in_key_order_across_kill_9s_without_duplicates() {
    use crate::postgres_pipeline::{insert_rows as pg_insert, pg_payload, SCHEMA as PG_SCHEMA};
    use crate::rig::scenario::check_records_by;
    let pg = crate::rig::Postgres::start(&[]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql("app", PG_SCHEMA);
    let nats = Nats::start();
    nats.add_stream("EVENTS", &["outbox.event.>"]);
    let body = format!(
        "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\nslot = \"outboxd_nats\"\n\
         publication = \"outboxd_nats\"\nheartbeat_interval_ms = 1000\n\
         [nats]\nurl = \"{}\"\n[http]\nlisten = \"\"\n",
        pg.url("cdc", "app"),
        nats.url()
    );
    let mut outboxd = Outboxd::new("nats-pg", &body);
    outboxd.start();
    let total = 3_000u64;
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for from in (0..total).step_by(50) {
                pg_insert(&pg, from, from + 50, 5);
            }
        });
        kill_9_and_restart(&mut outboxd, 3);
    });
    let got = nats.read("EVENTS", total as usize, READ_LIMIT);
    let records = consumed(&got);
    let duplicates = check_records_by(&records, 0..total, pg_payload);
    println!(
        "nats from postgres: {} messages for {total} rows after 3 kill -9: {duplicates} duplicates",
        records.len()
    );
    assert_eq!(duplicates, 0, "the stream keeps each row once");
    check_per_key_order(&records);
    outboxd.stop();
}

#[test]
fn a_payload_over_the_limit_or_the_servers_max_payload_is_dead_lettered_or_stops_outboxd() {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let nats = Nats::start();
    nats.add_stream("EVENTS", &["outbox.event.>"]);
    nats.add_stream("PARKED", &["outboxd.dlq"]);
    let big = |n: u64, bytes: usize| {
        format!(
            "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES (UNHEX('{n:032x}'), 'order', 'key-1', 'Created', REPEAT('x', {bytes}));"
        )
    };
    // The default limit sits below the server's 1 MiB max_payload: a 1.5 MB row is parked by the
    // router, the rows around it flow.
    let mut outboxd = Outboxd::new(
        "nats-big",
        &config_with_nats(
            &db.cdc_url(),
            &nats.url(),
            "dead_letter_topic = \"outboxd.dlq\"",
        ),
    );
    outboxd.start();
    insert_rows(&db, 0, 2, 1);
    db.sql_socket(&big(2, 1_500_000));
    insert_rows(&db, 3, 5, 1);
    let parked = nats.read("PARKED", 1, READ_LIMIT);
    assert_eq!(parked.len(), 1, "{}", outboxd.log());
    assert!(parked[0]
        .header("outboxd.error")
        .unwrap()
        .starts_with("too_large: "));
    assert_eq!(nats.read("EVENTS", 4, READ_LIMIT).len(), 4);
    outboxd.stop();
    // A limit above the server's: check warns, and the sink parks what max_payload refuses.
    let mut loose = Outboxd::new(
        "nats-big-loose",
        &config_with_nats(
            &db.cdc_url(),
            &nats.url(),
            "dead_letter_topic = \"outboxd.dlq\"\nmax_message_bytes = 4194304",
        ),
    );
    let shown = text(loose.command_output(&["check"]));
    assert!(shown.contains("WARN  nats max_payload"), "{shown}");
    loose.start();
    db.sql_socket(&big(5, 1_100_000));
    insert_rows(&db, 6, 7, 1);
    let parked = nats.read("PARKED", 2, READ_LIMIT);
    assert_eq!(parked.len(), 2, "{}", loose.log());
    let error = parked[1].header("outboxd.error").unwrap();
    assert!(
        error.contains("exceeds the server's max_payload"),
        "{error}"
    );
    assert_eq!(
        parked[1].header("outboxd.subject").as_deref(),
        Some("outbox.event.order")
    );
    assert_eq!(nats.read("EVENTS", 5, READ_LIMIT).len(), 5);
    loose.stop();
    // And without a dead-letter subject outboxd stops naming the setting, instead of looping.
    let mut strict = Outboxd::new(
        "nats-big-strict",
        &config_with_nats(&db.cdc_url(), &nats.url(), "max_message_bytes = 4194304"),
    );
    strict.start();
    db.sql_socket(&big(8, 1_100_000));
    assert!(!strict.wait_exit(Duration::from_secs(60)).success());
    assert!(strict.log().contains("max_payload"), "{}", strict.log());
}

/// A stream refuses one message of a window (here its `max_bytes` limit with `discard: new`
/// refuses a large row, while the small rows behind it still fit) and the rows already published
/// behind it must not be stored ahead of it: each message is published on the condition that the
/// stream's last message is outboxd's previous one (`Nats-Expected-Last-Msg-Id`), so once the
/// limit is raised the stream holds the key's rows in commit order, each once. Another publisher
/// writing between two of outboxd's messages breaks that condition: the session ends with a WARN
/// naming `nats.ordered` and the next one publishes without it, so nothing loops or stops.
#[test]
fn a_message_the_stream_refuses_mid_window_is_not_overtaken_by_the_rows_behind_it() {
    use async_nats::jetstream::stream::{Config, DiscardPolicy};
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let nats = Nats::start();
    nats.add_stream_config(Config {
        name: "EVENTS".into(),
        subjects: vec!["outbox.event.>".into()],
        duplicate_window: Duration::from_secs(120),
        discard: DiscardPolicy::New,
        max_bytes: 6_000,
        ..Default::default()
    });
    let row = |n: u64, bytes: usize| {
        format!(
            "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES (UNHEX('{n:032x}'), 'order', 'key-1', 'Created', REPEAT('x', {bytes}));"
        )
    };
    let ids = |got: &[Got]| -> Vec<String> {
        got.iter()
            .map(|g| g.header("Nats-Msg-Id").unwrap_or_default())
            .collect()
    };
    let config = config_with_nats(&db.cdc_url(), &nats.url(), "");
    let mut outboxd = Outboxd::new("nats-refused", &config);
    outboxd.start();
    // One transaction, one key: row 1 alone is over the stream's 6,000 bytes, the ten around it
    // are a few hundred bytes each.
    let mut sql = String::from("BEGIN;");
    for n in 0..11 {
        sql.push_str(&row(n, if n == 1 { 7_000 } else { 10 }));
    }
    sql.push_str("COMMIT;");
    db.sql_socket(&sql);
    wait_until("the stream to refuse row 1", READ_LIMIT, || {
        outboxd.log().contains("the stream refused a message")
    });
    let stored = nats.read("EVENTS", 1, READ_LIMIT);
    assert_eq!(
        ids(&stored),
        vec![uuid_of(0)],
        "only the row before the refused one is stored; {}",
        outboxd.log()
    );
    // The operator raises the limit: the next retry stores row 1, then the rest, in order.
    nats.update_stream("EVENTS", |c| c.max_bytes = 1_000_000);
    let stored = nats.read("EVENTS", 11, READ_LIMIT);
    assert_eq!(
        ids(&stored),
        (0..11).map(uuid_of).collect::<Vec<_>>(),
        "every row once, in commit order; {}",
        outboxd.log()
    );
    assert_eq!(
        stored[10].header("Nats-Expected-Last-Msg-Id").as_deref(),
        Some(uuid_of(9).as_str()),
        "each message names the one before it"
    );
    // Another publisher writes between two of outboxd's messages: the session ends with a WARN
    // naming nats.ordered, and the next one publishes without the condition, so the row goes.
    nats.publish("outbox.event.order", "not-outboxd-1", "{}");
    db.sql_socket(&row(11, 10));
    let stored = nats.read("EVENTS", 13, READ_LIMIT);
    assert_eq!(stored.len(), 13, "{}", outboxd.log());
    assert_eq!(
        stored[12].header("Nats-Msg-Id").as_deref(),
        Some(uuid_of(11).as_str())
    );
    let log = outboxd.log();
    assert!(
        log.contains("another publisher writes to the stream") && log.contains("nats.ordered"),
        "{log}"
    );
    // nats.ordered = false: no condition at all.
    outboxd.stop();
    outboxd.rewrite_config(&config.replace("[nats]\n", "[nats]\nordered = false\n"));
    outboxd.start();
    db.sql_socket(&format!("{}{}", row(12, 10), row(13, 10)));
    let stored = nats.read("EVENTS", 15, READ_LIMIT);
    assert_eq!(stored.len(), 15, "{}", outboxd.log());
    assert_eq!(stored[14].header("Nats-Expected-Last-Msg-Id"), None);
    outboxd.stop();
}
