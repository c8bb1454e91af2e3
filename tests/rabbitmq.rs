//! The RabbitMQ sink end to end, on a private RabbitMQ (Debian's rabbitmq-server) and MariaDB:
//! every row confirmed into its queue with its id, key and headers, in per-key order; unroutable
//! rows dead-lettered or stopping outboxd (never acked as delivered); kill -9 of outboxd and of the
//! broker under load lose nothing.

use std::time::Duration;

use crate::rig::rabbitmq::{config_with_rabbitmq, Got, RabbitMq};
use crate::rig::scenario::{
    check_per_key_order, check_records, insert_rows, kill_9_and_restart, spawn_writer, uuid_of,
    SCHEMA,
};
use crate::rig::{wait_until, Consumed, MariaDb, Outboxd};

const READ_LIMIT: Duration = Duration::from_secs(90);

/// MariaDB with the outbox schema and a RabbitMQ whose exchange `outbox` routes each aggregate
/// type to its own queue (`bindings`: queue, binding key).
fn servers(bindings: &[(&str, &str)]) -> (MariaDb, RabbitMq) {
    let db = MariaDb::start(&[]);
    db.sql_socket(SCHEMA);
    let rabbit = RabbitMq::start();
    rabbit.declare("outbox", bindings);
    (db, rabbit)
}

fn consumed(got: &[Got]) -> Vec<Consumed> {
    got.iter()
        .enumerate()
        .map(|(i, g)| g.as_consumed(i as i64))
        .collect()
}

#[test]
fn rows_reach_rabbitmq_confirmed_persistent_with_their_ids_keys_and_headers_in_key_order() {
    let (db, rabbit) = servers(&[
        ("orders", "outbox.event.order"),
        ("customers", "outbox.event.customer"),
    ]);
    let mut outboxd = Outboxd::new(
        "rabbit-e2e",
        &config_with_rabbitmq(&db.cdc_url(), &rabbit.url(), ""),
    );
    let check = outboxd.command(&["check"]).output().unwrap();
    let shown = String::from_utf8_lossy(&check.stdout).to_string();
    assert!(check.status.success(), "{shown}");
    assert!(
        shown.contains("PASS  rabbitmq exchange: \"outbox\" exists"),
        "{shown}"
    );
    outboxd.start();
    insert_rows(&db, 0, 300, 7);
    let mut got = rabbit.read("orders", 200, READ_LIMIT);
    got.extend(rabbit.read("customers", 100, READ_LIMIT));
    assert_eq!(got.len(), 300, "{}", outboxd.log());
    for g in &got {
        assert_eq!(g.delivery_mode, Some(2), "persistent");
        let id = g.header("id").unwrap();
        assert_eq!(
            g.message_id.as_deref(),
            Some(id.as_str()),
            "message_id = row id"
        );
    }
    let records = consumed(&got);
    assert_eq!(
        check_records(&records, 0..300),
        0,
        "no duplicates without faults"
    );
    check_per_key_order(&records);
    wait_until("the checkpoint to pass the last row", READ_LIMIT, || {
        outboxd.checkpoint()["position"]["gtid_set"]
            == db.sql_socket("SELECT @@gtid_binlog_pos;").trim()
    });
    outboxd.stop();
}

#[test]
fn an_unroutable_row_is_dead_lettered_and_without_a_dead_letter_key_outboxd_stops_naming_it() {
    // Only orders are bound: customer rows (every third) are returned by the exchange.
    let (db, rabbit) = servers(&[("orders", "outbox.event.order"), ("parked", "outboxd.dlq")]);
    let mut outboxd = Outboxd::new(
        "rabbit-dlq",
        &config_with_rabbitmq(
            &db.cdc_url(),
            &rabbit.url(),
            "dead_letter_topic = \"outboxd.dlq\"",
        ),
    );
    outboxd.start();
    insert_rows(&db, 0, 90, 9);
    let orders = rabbit.read("orders", 60, READ_LIMIT);
    let parked = rabbit.read("parked", 30, READ_LIMIT);
    assert_eq!(orders.len(), 60, "{}", outboxd.log());
    assert_eq!(parked.len(), 30, "{}", outboxd.log());
    for p in &parked {
        let n = u64::from_str_radix(&p.header("id").unwrap().replace('-', ""), 16).unwrap();
        assert_eq!(n % 3, 0, "only customer rows are unroutable");
        assert_eq!(p.header("id").unwrap(), uuid_of(n));
        assert_eq!(
            p.header("outboxd.routing_key").as_deref(),
            Some("outbox.event.customer")
        );
        assert!(p
            .header("outboxd.error")
            .unwrap()
            .starts_with("unroutable: "));
    }
    check_per_key_order(&consumed(&orders));
    outboxd.stop();

    // The same rows again, with nowhere to park them: outboxd exits naming exchange and key, and
    // keeps its checkpoint before the row (nothing acked as delivered).
    let mut strict = Outboxd::new(
        "rabbit-strict",
        &config_with_rabbitmq(&db.cdc_url(), &rabbit.url(), ""),
    );
    strict.start();
    let before = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    // Row 90 is a customer row, first in its transaction.
    insert_rows(&db, 90, 99, 9);
    let status = strict.wait_exit(Duration::from_secs(60));
    assert!(!status.success());
    let log = strict.log();
    assert!(
        log.contains(
            "no queue is bound to exchange \"outbox\" for routing key \"outbox.event.customer\""
        ),
        "{log}"
    );
    assert!(log.contains("set rabbitmq.dead_letter_topic"), "{log}");
    assert!(!log.contains("café"), "no row data in the log: {log}");
    // Nothing of that transaction may be checkpointed (the return is not a delivery).
    assert_eq!(
        strict.checkpoint()["position"]["gtid_set"],
        before.as_str(),
        "{log}"
    );
    // And a restart stops again on the same row: nothing was skipped.
    strict.start_until(&[], &[], &["stream opened"]);
    assert!(!strict.wait_exit(Duration::from_secs(60)).success());
    assert_eq!(strict.checkpoint()["position"]["gtid_set"], before.as_str());
}

#[test]
fn kill_9_of_outboxd_and_of_rabbitmq_under_load_loses_nothing_and_keeps_key_order() {
    let (db, mut rabbit) = servers(&[
        ("orders", "outbox.event.order"),
        ("customers", "outbox.event.customer"),
    ]);
    let mut outboxd = Outboxd::new(
        "rabbit-kill",
        &config_with_rabbitmq(&db.cdc_url(), &rabbit.url(), "message_timeout_ms = 20000"),
    );
    outboxd.start();
    let total = 6_000u64;
    let writer = spawn_writer(db.socket_path(), total, &[1, 9, 40], 10);
    kill_9_and_restart(&mut outboxd, 5);
    // The broker dies under load and comes back (same node, same disk): what it confirmed is
    // kept, what it did not is published again from the checkpoint.
    rabbit.kill9();
    rabbit.boot();
    writer.join().unwrap();
    let mut got = rabbit.read("orders", 4_000, READ_LIMIT);
    got.extend(rabbit.read("customers", 2_000, READ_LIMIT));
    let records = consumed(&got);
    let duplicates = check_records(&records, 0..total);
    println!(
        "rabbitmq: {} messages for {total} rows after 5 kill -9 of outboxd and one of RabbitMQ: {duplicates} duplicates",
        records.len()
    );
    check_per_key_order(&records);
    outboxd.stop();
}

#[test]
fn a_rabbitmq_password_is_never_printed_and_a_refused_login_stops_without_looping() {
    const PASSWORD: &str = "planted-amqp-pw-81";
    const WRONG: &str = "planted-amqp-wrong-82";
    let db = MariaDb::start(&[]);
    db.sql_socket(SCHEMA);
    let rabbit = RabbitMq::start_with_user("outboxd", PASSWORD);
    rabbit.declare("outbox", &[("orders", "outbox.event.#")]);
    let text = |out: std::process::Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let no_secret = |what: &str, text: &str| {
        for secret in [PASSWORD, WRONG] {
            assert!(!text.contains(secret), "{what} printed {secret}:\n{text}");
        }
    };
    // A wrong password, in the file: `check` FAILs naming the login, `run` exits (a refused login
    // is the operator's to fix, not a reason to retry forever).
    let wrong = rabbit.url().replace(PASSWORD, WRONG);
    let outboxd = Outboxd::new(
        "rabbit-secrets",
        &config_with_rabbitmq(&db.cdc_url(), &wrong, ""),
    );
    let check = text(outboxd.command(&["check"]).output().unwrap());
    assert!(
        check.contains("FAIL  rabbitmq: RabbitMQ at amqp://outboxd:***@127.0.0.1"),
        "{check}"
    );
    assert!(check.contains("refused the login"), "{check}");
    no_secret("check", &check);
    let (ok, log) = crate::tls::output(&outboxd, &["run", "--skip-checks"]);
    assert!(!ok, "{log}");
    assert!(log.contains("refused the login"), "{log}");
    no_secret("run", &log);
    // The right one through the environment, with lapin's own logging on: still never printed.
    let mut outboxd = Outboxd::new(
        "rabbit-secrets-env",
        &config_with_rabbitmq(&db.cdc_url(), "amqp://placeholder:5672/%2f", ""),
    );
    let env = [("OUTBOXD_RABBITMQ__URL", rabbit.url())];
    let check = text(
        outboxd
            .command(&["check"])
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .env("RUST_LOG", "debug")
            .output()
            .unwrap(),
    );
    assert!(check.contains("PASS  rabbitmq exchange"), "{check}");
    no_secret("check with the URL from the environment", &check);
    outboxd.start_with_env(
        &[],
        &[
            ("OUTBOXD_RABBITMQ__URL", &rabbit.url()),
            ("RUST_LOG", "debug"),
        ],
    );
    insert_rows(&db, 0, 3, 1);
    assert_eq!(rabbit.read("orders", 3, READ_LIMIT).len(), 3);
    outboxd.stop();
    no_secret("run with debug logging", &outboxd.log());
}

#[test]
fn a_frozen_rabbitmq_past_the_delivery_timeout_and_a_sigterm_while_it_is_frozen_lose_nothing() {
    let (db, rabbit) = servers(&[
        ("orders", "outbox.event.order"),
        ("customers", "outbox.event.customer"),
    ]);
    let mut outboxd = Outboxd::new(
        "rabbit-frozen",
        &config_with_rabbitmq(
            &db.cdc_url(),
            &rabbit.url(),
            "message_timeout_ms = 3000\ndrain_timeout_ms = 2000",
        ),
    );
    outboxd.start();
    rabbit.freeze();
    insert_rows(&db, 0, 300, 10);
    let waited = std::time::Instant::now();
    while !outboxd.log().contains("for the broker's acknowledgement") {
        assert!(
            waited.elapsed() < READ_LIMIT,
            "no delivery timeout:\n{}",
            outboxd.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    rabbit.thaw();
    // SIGTERM while the broker is frozen: the exit is bounded by drain_timeout_ms, and what was
    // not confirmed is published again by the next start.
    rabbit.freeze();
    insert_rows(&db, 300, 400, 10);
    let stopping = std::thread::spawn({
        let pid = outboxd.pid();
        move || nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)
    });
    stopping.join().unwrap().unwrap();
    outboxd.wait_exit(Duration::from_secs(30));
    rabbit.thaw();
    outboxd.start();
    let mut got = rabbit.read("orders", 266, READ_LIMIT);
    got.extend(rabbit.read("customers", 134, READ_LIMIT));
    let records = consumed(&got);
    let duplicates = check_records(&records, 0..400);
    println!(
        "rabbitmq frozen: {} messages for 400 rows, {duplicates} duplicates",
        records.len()
    );
    check_per_key_order(&records);
    assert!(
        !rabbit.log().contains("CRASH REPORT"),
        "the broker survived its freezes"
    );
    outboxd.stop();
}
