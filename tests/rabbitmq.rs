//! The RabbitMQ sink end to end, on a private RabbitMQ (Debian's rabbitmq-server) and MariaDB:
//! every row confirmed into its queue with its id, key and headers, in per-key order; unroutable
//! rows dead-lettered or stopping outboxd (never acked as delivered); kill -9 of outboxd and of the
//! broker under load lose nothing.

use std::time::Duration;

use crate::rig::rabbitmq::{config_with_rabbitmq, Got, RabbitMq};
use crate::rig::scenario::{
    check_per_key_order, check_records, insert_rows, kill_9_and_restart, n_of, spawn_writer,
    uuid_of, SCHEMA,
};
use crate::rig::{free_port, http_get, wait_until, Consumed, Mysqld, Outboxd};

const READ_LIMIT: Duration = Duration::from_secs(90);

/// MariaDB with the outbox schema and a RabbitMQ whose exchange `outbox` routes each aggregate
/// type to its own queue (`bindings`: queue, binding key).
fn servers(bindings: &[(&str, &str)]) -> (Mysqld, RabbitMq) {
    let db = Mysqld::mariadb(&[]);
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
    let http = free_port();
    let mut outboxd = Outboxd::new(
        "rabbit-e2e",
        &config_with_rabbitmq(&db.cdc_url(), &rabbit.url(), "")
            .replace("listen = \"\"", &format!("listen = \"127.0.0.1:{http}\"")),
    );
    let check = outboxd.command_output(&["check"]);
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
        outboxd.checkpoint_or_null()["position"]["gtid_set"]
            == db.sql_socket("SELECT @@gtid_binlog_pos;").trim()
    });
    let (_, metrics) = http_get(http, "/metrics");
    for line in [
        r#"outboxd_events_forwarded_total{pipeline="rabbit-e2e",sink="rabbitmq",topic="outbox.event.order"} 200"#,
        r#"outboxd_events_forwarded_total{pipeline="rabbit-e2e",sink="rabbitmq",topic="outbox.event.customer"} 100"#,
        r#"outboxd_inflight_events{pipeline="rabbit-e2e",sink="rabbitmq"} 0"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
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
    // Many returns interleaved with confirms (a third of the rows): RabbitMQ coalesces confirms
    // and sends them out of order, so returns reach lapin's queue ahead of the confirms that take
    // them. Any settling on a guess shows as a reconnect (a return no one waits for) and duplicates.
    insert_rows(&db, 0, 900, 9);
    let orders = rabbit.read("orders", 600, READ_LIMIT);
    let parked = rabbit.read("parked", 300, READ_LIMIT);
    assert_eq!(orders.len(), 600, "{}", outboxd.log());
    assert_eq!(parked.len(), 300, "{}", outboxd.log());
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
    // Row 900 is a customer row, first in its transaction.
    insert_rows(&db, 900, 909, 9);
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
    // (Run to its exit: it may stop before a start could see the stream open.)
    let (ok, log) = crate::tls::output(&strict, &["run", "--skip-checks"]);
    assert!(!ok && log.contains("no queue is bound"), "{log}");
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
    let mut got = rabbit.read("orders", 4_000, READ_LIMIT);
    got.extend(rabbit.read("customers", 2_000, READ_LIMIT));
    let records = consumed(&got);
    let duplicates = check_records(&records, 0..total);
    println!(
        "rabbitmq: {} messages for {total} rows after 5 kill -9 of outboxd and one of RabbitMQ: {duplicates} duplicates",
        records.len()
    );
    // What the product promises: each fault resends at most the unconfirmed window
    // (max_in_flight, 2,000) and what was confirmed but not yet checkpointed (the rig writes the
    // checkpoint every 20 ms); six faults here.
    assert!(
        duplicates <= 6 * (2_000 + 200),
        "{duplicates} duplicates exceed six windows"
    );
    check_per_key_order(&records);
    outboxd.stop();
}

#[test]
fn a_rabbitmq_password_is_never_printed_and_a_refused_login_stops_without_looping() {
    const PASSWORD: &str = "planted-amqp-pw-81";
    const WRONG: &str = "planted-amqp-wrong-82";
    let db = Mysqld::mariadb(&[]);
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
    let check = text(outboxd.command_output(&["check"]));
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

#[test]
fn amqps_verifies_the_brokers_certificate_against_the_ca_file_and_refuses_a_wrong_ca_or_host() {
    use crate::rig::certs::{Ca, VALID};
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "outboxd test CA", "ca");
    let other_ca = Ca::new(dir.path(), "some other CA", "other-ca");
    let server = ca.server(dir.path(), "server", &["127.0.0.1"], VALID);
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let rabbit = RabbitMq::start_tls(&ca.pem, &server);
    rabbit.declare("outbox", &[("orders", "outbox.event.#")]);
    let pipeline = |name: &str, url: &str, ca: &std::path::Path| {
        Outboxd::new(
            name,
            &config_with_rabbitmq(
                &db.cdc_url(),
                url,
                &format!("ca_file = \"{}\"", ca.display()),
            ),
        )
    };
    // The right CA: check passes, rows flow over TLS.
    let mut outboxd = pipeline("rabbit-tls", &rabbit.tls_url("127.0.0.1"), &ca.pem);
    let (ok, shown) = crate::tls::output(&outboxd, &["check"]);
    assert!(
        ok && shown.contains("PASS  rabbitmq: connected to amqps://"),
        "{shown}"
    );
    outboxd.start();
    insert_rows(&db, 0, 5, 1);
    assert_eq!(rabbit.read("orders", 5, READ_LIMIT).len(), 5);
    outboxd.stop();
    // Another CA, and a host name the certificate does not carry: refused by check and by run
    // (which exits: a certificate does not heal by retrying).
    for (name, url, trusted) in [
        ("rabbit-tls-ca", rabbit.tls_url("127.0.0.1"), &other_ca.pem),
        ("rabbit-tls-host", rabbit.tls_url("localhost"), &ca.pem),
    ] {
        let outboxd = pipeline(name, &url, trusted);
        let (ok, shown) = crate::tls::output(&outboxd, &["check"]);
        assert!(
            !ok && shown.contains("FAIL  rabbitmq: TLS to RabbitMQ"),
            "{name}: {shown}"
        );
        let (ok, log) = crate::tls::output(&outboxd, &["run", "--skip-checks"]);
        assert!(!ok && log.contains("TLS to RabbitMQ"), "{name}: {log}");
    }
}

#[test]
fn postgres_rows_reach_rabbitmq_in_key_order_across_kill_9s() {
    use crate::postgres_pipeline::{insert_rows as pg_insert, pg_payload, SCHEMA as PG_SCHEMA};
    use crate::rig::scenario::check_records_by;
    let pg = crate::rig::Postgres::start(&[]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql("app", PG_SCHEMA);
    let rabbit = RabbitMq::start();
    rabbit.declare(
        "outbox",
        &[
            ("orders", "outbox.event.order"),
            ("customers", "outbox.event.customer"),
        ],
    );
    let body = format!(
        "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\nslot = \"outboxd_rabbit\"\n\
         publication = \"outboxd_rabbit\"\nheartbeat_interval_ms = 1000\n\
         [rabbitmq]\nurl = \"{}\"\nexchange = \"outbox\"\n[http]\nlisten = \"\"\n",
        pg.url("cdc", "app"),
        rabbit.url()
    );
    let mut outboxd = Outboxd::new("rabbit-pg", &body);
    outboxd.start();
    let total = 3_000u64;
    std::thread::scope(|scope| {
        // Fifty rows per client call, so that the kills land mid-stream.
        scope.spawn(|| {
            for from in (0..total).step_by(50) {
                pg_insert(&pg, from, from + 50, 5);
            }
        });
        kill_9_and_restart(&mut outboxd, 3);
    });
    let mut got = rabbit.read("orders", 2_000, READ_LIMIT);
    got.extend(rabbit.read("customers", 1_000, READ_LIMIT));
    let records = consumed(&got);
    let duplicates = check_records_by(&records, 0..total, pg_payload);
    println!(
        "rabbitmq from postgres: {} messages for {total} rows after 3 kill -9: {duplicates} duplicates",
        records.len()
    );
    check_per_key_order(&records);
    outboxd.stop();
}

#[test]
fn a_payload_over_the_message_size_is_dead_lettered_and_one_the_broker_refuses_stops_outboxd() {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let rabbit = RabbitMq::start_with_conf("max_message_size = 1048576\n");
    rabbit.declare(
        "outbox",
        &[("orders", "outbox.event.#"), ("parked", "outboxd.dlq")],
    );
    let big = |n: u64| {
        format!(
            "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES (UNHEX('{:032x}'), 'order', 'key-1', 'Created', REPEAT('x', 1500000));",
            n
        )
    };
    // max_message_bytes matches the broker's max_message_size: the big row is parked, the rows
    // around it flow.
    let mut outboxd = Outboxd::new(
        "rabbit-big",
        &config_with_rabbitmq(
            &db.cdc_url(),
            &rabbit.url(),
            "dead_letter_topic = \"outboxd.dlq\"\nmax_message_bytes = 1048576",
        ),
    );
    outboxd.start();
    insert_rows(&db, 0, 2, 1);
    db.sql_socket(&big(2));
    insert_rows(&db, 3, 5, 1);
    let parked = rabbit.read("parked", 1, READ_LIMIT);
    assert_eq!(parked.len(), 1, "{}", outboxd.log());
    assert!(
        parked[0]
            .header("outboxd.error")
            .unwrap()
            .starts_with("too_large: "),
        "{:?}",
        parked[0].header("outboxd.error")
    );
    assert_eq!(rabbit.read("orders", 4, READ_LIMIT).len(), 4);
    outboxd.stop();
    // Without the limit the broker refuses the message (it closes the channel): outboxd stops
    // naming the broker's setting instead of publishing it again and again.
    let mut strict = Outboxd::new(
        "rabbit-big-strict",
        &config_with_rabbitmq(&db.cdc_url(), &rabbit.url(), ""),
    );
    strict.start();
    db.sql_socket(&big(5));
    let status = strict.wait_exit(Duration::from_secs(60));
    assert!(!status.success());
    assert!(
        strict.log().contains("max_message_size"),
        "{}",
        strict.log()
    );
}

#[test]
fn sigterm_exits_at_the_drain_deadline_while_a_memory_alarm_blocks_publishing() {
    // A broker over its memory watermark blocks publishing connections: it stops reading them but
    // answers heartbeats, so nothing fails; once the socket buffers are full a publish waits.
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let rabbit = RabbitMq::start_with_conf("vm_memory_high_watermark.absolute = 1\n");
    rabbit.declare("outbox", &[("orders", "outbox.event.#")]);
    let http = free_port();
    let mut outboxd = Outboxd::new(
        "rabbit-alarm",
        &config_with_rabbitmq(
            &db.cdc_url(),
            &rabbit.url(),
            "drain_timeout_ms = 2000\nmessage_timeout_ms = 0",
        )
        .replace("listen = \"\"", &format!("listen = \"127.0.0.1:{http}\"")),
    );
    outboxd.start();
    // The broker raises the alarm at its first memory check after boot.
    wait_until("the memory alarm", READ_LIMIT, || {
        rabbit.log().contains("Publishers will be blocked")
    });
    let rows: String = (0..60u64)
        .map(|n| {
            format!(
                "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES (UNHEX('{n:032x}'), 'order', 'key-1', 'Created', REPEAT('x', 500000));"
            )
        })
        .collect();
    db.sql_socket(&rows);
    // Publishing stalls with records in flight that the blocked broker never confirms.
    wait_until(
        "records in flight to the blocked broker",
        READ_LIMIT,
        || {
            let (_, metrics) = http_get(http, "/metrics");
            metrics
                .lines()
                .find(|l| l.starts_with("outboxd_inflight_events{"))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|n| n.parse::<f64>().ok())
                .is_some_and(|n| n >= 1.0)
        },
    );
    let before = outboxd.checkpoint()["position"].clone();
    nix::sys::signal::kill(outboxd.pid(), nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = outboxd.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{}", outboxd.log());
    assert_eq!(
        outboxd.checkpoint()["position"],
        before,
        "nothing was confirmed, so nothing may be checkpointed"
    );
}

/// A full queue with `x-overflow = reject-publish` nacks, and RabbitMQ still enqueues the message
/// in every other queue bound to its key. After a nack outboxd publishes one message at a time,
/// so each retry repeats a message or two in the queue beside it (not the whole window), and once the
/// full queue is read every row reaches it, in key order.
#[test]
fn a_full_reject_publish_queue_costs_the_queues_beside_it_one_message_per_retry() {
    let (db, rabbit) = servers(&[
        ("copy", "outbox.event.order"),
        ("customers", "outbox.event.customer"),
    ]);
    rabbit.declare_limited("outbox", "limited", "outbox.event.order", 50);
    let mut outboxd = Outboxd::new(
        "rabbit-full",
        &config_with_rabbitmq(&db.cdc_url(), &rabbit.url(), ""),
    );
    outboxd.start();
    // 200 order rows (and 100 customer rows): the limited queue takes 50.
    insert_rows(&db, 0, 300, 1);
    let ended = || outboxd.log().matches("session ended; reconnecting").count() as u32;
    // Counted between two later points, past the first nack (whose session had a whole window in
    // flight): what each retry adds. One or two per retry were measured (a session may resend a
    // message confirmed after the checkpoint it started from); a session in progress at either
    // count adds one more. Without the careful window each retry added a window's worth.
    wait_until("two sessions to end on the nack", READ_LIMIT, || {
        ended() >= 2
    });
    let (before, first) = (rabbit.queue_len("copy"), ended());
    wait_until("three more sessions to end", READ_LIMIT, || {
        ended() >= first + 3
    });
    let (after, last) = (rabbit.queue_len("copy"), ended());
    let retries = last - first;
    assert!(
        after - before <= 2 * retries + 2,
        "{} messages added to the queue beside the full one over {retries} retries: more than two repeats per retry",
        after - before
    );
    let got = rabbit.read("limited", 200, READ_LIMIT);
    let records = consumed(&got);
    let rows: std::collections::BTreeSet<u64> = records.iter().map(n_of).collect();
    assert_eq!(rows.len(), 200, "{}", outboxd.log());
    check_per_key_order(&records);
    outboxd.stop();
}
