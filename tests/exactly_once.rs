//! Exactly-once delivery (`kafka.exactly_once`): records and the checkpoint of their end commit in
//! one Kafka transaction, so a `read_committed` consumer sees each row once across kill -9s, a
//! frozen broker and a failover. On Apache Kafka.

use std::time::Duration;

use crate::operate::output;
use crate::postgres_pipeline::{insert_sql as pg_insert_sql, pg_payload, SCHEMA as PG_SCHEMA};
use crate::rig::broker::Broker;
use crate::rig::kafka::{consume_to_end, PAUSE, ROUND};
use crate::rig::mysqld::Mysqld;
use crate::rig::outboxd::Outboxd;
use crate::rig::scenario::*;
use crate::rig::{create_topic, free_port, http_get, wait_until, Consumed, Postgres};
use crate::standby::committed_checkpoints;

const TOPICS: [&str; 2] = ["outbox.event.order", "outbox.event.customer"];

/// The `[checkpoint]` keys of every test here (a restart after kill -9 waits out the takeover
/// timeout, so it is short).
const CHECKPOINT: &str = "store = \"kafka\"\ntakeover_timeout_ms = 1500\n";

/// The `[kafka]` keys: exactly-once, and a window small enough that kills land mid-transaction.
const EXACTLY_ONCE: &str = "exactly_once = true\nmax_in_flight = 1000";

fn broker_with_topics() -> Broker {
    let broker = Broker::start();
    for topic in TOPICS {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    broker
}

/// A MariaDB with the outbox schema, and Apache Kafka with the event topics.
fn mariadb_and_broker() -> (Mysqld, Broker) {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    (db, broker_with_topics())
}

/// Both event topics as a consumer with `isolation` sees them, read until `done` holds (or
/// [`LIMIT`] passed).
fn consume_as(
    broker: &Broker,
    isolation: &str,
    done: impl Fn(&[Consumed]) -> bool,
) -> Vec<Consumed> {
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let client = [
            ("bootstrap.servers", broker.bootstrap()),
            ("isolation.level", isolation.to_string()),
        ];
        let client: Vec<(&str, &str)> = client.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let all: Vec<Consumed> = TOPICS
            .iter()
            .flat_map(|topic| consume_to_end(&client, topic, ROUND))
            .collect();
        if done(&all) || std::time::Instant::now() > deadline {
            return all;
        }
        std::thread::sleep(PAUSE);
    }
}

fn distinct(records: &[Consumed]) -> usize {
    records
        .iter()
        .map(|r| r.header("id"))
        .collect::<std::collections::HashSet<_>>()
        .len()
}

/// What a `read_committed` consumer sees once every row arrived and outboxd stopped cleanly:
/// asserted to hold each of `total` rows exactly once, in per-key order.
fn assert_exactly_once(
    broker: &Broker,
    outboxd: &mut Outboxd,
    total: u64,
    payload_of: impl Fn(u64) -> String,
) -> Vec<Consumed> {
    consume_as(broker, "read_committed", |all| {
        distinct(all) >= total as usize
    });
    let status = outboxd.stop();
    assert!(status.success(), "{}", outboxd.log());
    let records = consume_as(broker, "read_committed", |all| {
        distinct(all) >= total as usize
    });
    let duplicates = check_records_by(&records, 0..total, payload_of);
    assert_eq!(
        duplicates, 0,
        "a read_committed consumer saw {duplicates} duplicates"
    );
    assert_eq!(records.len(), total as usize);
    check_per_key_order(&records);
    records
}

fn mariadb_outboxd(db: &Mysqld, broker: &Broker, name: &str, kafka: &str, http: &str) -> Outboxd {
    Outboxd::with_checkpoint(
        name,
        &config_body(&db.cdc_url(), &broker.bootstrap(), kafka, http),
        CHECKPOINT,
    )
}

/// Kills outboxd ten times while rows are written, then freezes the broker for 30 s under load:
/// a read_committed consumer sees each row exactly once.
#[test]
fn exactly_once_on_mariadb_survives_ten_kill_9s_and_a_frozen_broker() {
    let (db, broker) = mariadb_and_broker();
    let port = free_port();
    let mut outboxd = mariadb_outboxd(
        &db,
        &broker,
        "eos-maria",
        EXACTLY_ONCE,
        &format!("127.0.0.1:{port}"),
    );
    outboxd.start();
    let total = 12_000u64;
    let first = 8_000u64;
    let writer = spawn_writer(db.socket_path(), first, &[1, 7, 50, 200], 20);
    kill_9_and_restart(&mut outboxd, 10);
    writer.join().unwrap();
    consume_as(&broker, "read_committed", |all| {
        distinct(all) >= first as usize
    });
    broker.freeze();
    let script = transactions(first, total, 10, insert_sql);
    db.sql_socket(&script);
    std::thread::sleep(Duration::from_secs(30));
    broker.thaw();
    consume_as(&broker, "read_committed", |all| {
        distinct(all) >= total as usize
    });
    let metrics = http_get(port, "/metrics").1;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("outboxd_transactions_total")
                && l.contains("result=\"committed\"")),
        "{metrics}"
    );
    let records = assert_exactly_once(&broker, &mut outboxd, total, |n| event(n).3);
    let uncommitted = consume_as(&broker, "read_uncommitted", |all| {
        all.len() >= records.len()
    });
    println!(
        "exactly-once, MariaDB: {total} rows, 10 kill -9 and a 30 s broker freeze: {} records read_committed, {} read_uncommitted (aborted transactions' records stay hidden)",
        records.len(),
        uncommitted.len()
    );
    // Every row's transaction committed, so the last committed checkpoint is at the binlog's end.
    let end = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    let client = [("bootstrap.servers", broker.bootstrap())];
    let client: Vec<(&str, &str)> = client.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let client = [client, vec![("isolation.level", "read_committed")]].concat();
    // Kafka writes a transaction's commit markers after EndTxn returns: read again until the
    // newest committed checkpoint shows, and name it if it never does.
    let last_checkpoint = || {
        consume_to_end(&client, "outboxd.checkpoints", ROUND)
            .into_iter()
            .filter(|r| r.key.as_deref() == Some(b"eos-maria".as_slice()))
            .filter_map(|r| serde_json::from_slice::<serde_json::Value>(r.value.as_deref()?).ok())
            .next_back()
    };
    let at_end = |c: &Option<serde_json::Value>| {
        c.as_ref()
            .is_some_and(|c| c["position"]["gtid_set"] == end.as_str())
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut last = last_checkpoint();
    while !at_end(&last) && std::time::Instant::now() < deadline {
        std::thread::sleep(PAUSE);
        last = last_checkpoint();
    }
    assert!(
        at_end(&last),
        "the last committed checkpoint: {last:?}; the end: {end}"
    );
}

/// The same on Postgres: the slot is confirmed only up to what a committed transaction stored.
#[test]
fn exactly_once_on_postgres_survives_ten_kill_9s_and_a_frozen_broker() {
    let pg = Postgres::start(&[]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql("app", PG_SCHEMA);
    let broker = broker_with_topics();
    let body = format!(
        "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\nslot = \"outboxd_eos\"\n\
         publication = \"outboxd_eos\"\nheartbeat_interval_ms = 1000\n\
         [kafka]\nbrokers = \"{}\"\n{EXACTLY_ONCE}\n[http]\nlisten = \"\"\n",
        pg.url("cdc", "app"),
        broker.bootstrap()
    );
    let mut outboxd = Outboxd::with_checkpoint("eos-pg", &body, CHECKPOINT);
    outboxd.start();
    let total = 6_000u64;
    let first = 4_000u64;
    std::thread::scope(|scope| {
        let pg = &pg;
        let writer = scope.spawn(move || {
            let sizes = [1u64, 7, 50, 200];
            let (mut n, mut i) = (0u64, 0usize);
            while n < first {
                let end = (n + sizes[i % sizes.len()]).min(first);
                i += 1;
                pg.sql("app", &transactions(n, end, end - n, pg_insert_sql));
                n = end;
            }
        });
        kill_9_and_restart(&mut outboxd, 10);
        writer.join().unwrap();
    });
    consume_as(&broker, "read_committed", |all| {
        distinct(all) >= first as usize
    });
    broker.freeze();
    pg.sql("app", &transactions(first, total, 10, pg_insert_sql));
    std::thread::sleep(Duration::from_secs(30));
    broker.thaw();
    let records = assert_exactly_once(&broker, &mut outboxd, total, pg_payload);
    println!(
        "exactly-once, Postgres: {total} rows, 10 kill -9 and a 30 s broker freeze: {} records read_committed",
        records.len()
    );
}

/// An exactly-once transaction whose index entry gets stuck in librdkafka (its
/// `send_offsets_to_transaction` waiting for a group coordinator it lost, confluentinc/librdkafka#5456):
/// the session gives that producer up and the next one, which fences it, sends the rows again;
/// a read_committed consumer sees each once. The first entry is the first start's checkpoint
/// (the store's writer), the second this sink's first transaction.
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_transaction_stuck_in_librdkafka_is_given_up_and_sent_again_once() {
    let (db, broker) = mariadb_and_broker();
    let mut outboxd = mariadb_outboxd(&db, &broker, "eos-stuck", EXACTLY_ONCE, "");
    outboxd.start_with_env(
        &[],
        &[("FAILPOINTS", "index_send_hangs=1*off->1*sleep(600000)")],
    );
    insert_rows(&db, 0, 100, 5);
    assert_exactly_once(&broker, &mut outboxd, 100, |n| event(n).3);
    assert!(
        outboxd.log().contains("did not return within"),
        "{}",
        outboxd.log()
    );
}

/// A crash after the records and the checkpoint record were written, before the commit: they stay
/// in the log (a read_uncommitted consumer sees them) but were never committed, so the restart
/// sends them again and a read_committed consumer sees each row once.
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_crash_before_the_commit_hides_the_transaction_and_the_restart_sends_it_once() {
    use outboxd::fault::BEFORE_TRANSACTION_COMMIT;
    let (db, broker) = mariadb_and_broker();
    let mut outboxd = mariadb_outboxd(
        &db,
        &broker,
        "eos-crash",
        "exactly_once = true\ntransaction_interval_ms = 5000\ntransaction_max_records = 100",
        "",
    );
    // Its first commit holds rows 0..102 (the boundary after 100 records; the interval is far
    // off); the second crashes after its records and checkpoint were written.
    outboxd.start_with_env(
        &[],
        &[(
            "FAILPOINTS",
            &format!("{BEFORE_TRANSACTION_COMMIT}=1*off->return"),
        )],
    );
    insert_rows(&db, 0, 300, 3);
    let status = outboxd.wait_exit(LIMIT);
    assert!(
        !status.success(),
        "the fail point did not fire: {}",
        outboxd.log()
    );
    let committed = consume_as(&broker, "read_committed", |_| true);
    let uncommitted = consume_as(&broker, "read_uncommitted", |all| {
        all.len() > committed.len()
    });
    assert!(
        uncommitted.len() > committed.len(),
        "the crashed transaction's records were written ({} read_uncommitted) but not committed ({} read_committed)",
        uncommitted.len(),
        committed.len()
    );
    outboxd.start();
    let records = assert_exactly_once(&broker, &mut outboxd, 300, |n| event(n).3);
    let uncommitted = consume_as(&broker, "read_uncommitted", |all| all.len() > 300);
    println!(
        "exactly-once crash before commit: {} records read_committed, {} read_uncommitted",
        records.len(),
        uncommitted.len()
    );
    assert!(uncommitted.len() > 300, "{}", uncommitted.len());
}

/// Two instances, exactly-once: the leader is killed under load, the standby takes over, and a
/// read_committed consumer sees each row once.
#[test]
fn exactly_once_holds_across_a_failover_to_a_standby() {
    let (db, broker) = mariadb_and_broker();
    let (a_port, b_port) = (free_port(), free_port());
    let mut a = mariadb_outboxd(
        &db,
        &broker,
        "eos-failover",
        EXACTLY_ONCE,
        &format!("127.0.0.1:{a_port}"),
    );
    let mut b = mariadb_outboxd(
        &db,
        &broker,
        "eos-failover",
        EXACTLY_ONCE,
        &format!("127.0.0.1:{b_port}"),
    );
    a.start();
    wait_until("the leader to be ready", Duration::from_secs(30), || {
        http_get(a_port, "/readyz") == (200, "ready: leader\n".into())
    });
    b.start_until(&[], &[], &["standing by"]);
    let total = 6_000u64;
    let writer = spawn_writer(db.socket_path(), total, &[1, 7, 50], 10);
    consume_as(&broker, "read_committed", |all| distinct(all) >= 500);
    a.kill9();
    wait_until("the standby to take over", Duration::from_secs(60), || {
        http_get(b_port, "/readyz") == (200, "ready: leader\n".into())
    });
    writer.join().unwrap();
    let records = assert_exactly_once(&broker, &mut b, total, |n| event(n).3);
    println!(
        "exactly-once failover: {} records read_committed for {total} rows",
        records.len()
    );
}

/// `checkpoint set` while the exactly-once leader is frozen with a transaction open (it counts as
/// stopped once its lead is older than twice the takeover timeout), back to the start to send
/// everything again: when the leader wakes up, its open transaction must not commit a checkpoint
/// over the one the operator wrote, or the rows before it would not be sent again.
#[test]
fn a_frozen_leader_cannot_commit_over_a_checkpoint_set_meanwhile() {
    use nix::sys::signal::{kill, Signal};
    let (db, broker) = mariadb_and_broker();
    // 100 records commit a transaction; fewer wait 20 s. Slow heartbeats: the woken leader must
    // not find its source silent and drop the session (which aborts) before it can commit.
    let body = config_body(
        &db.cdc_url(),
        &broker.bootstrap(),
        "exactly_once = true\ntransaction_interval_ms = 20000\ntransaction_max_records = 100",
        "",
    )
    .replace(
        "heartbeat_interval_ms = 1000",
        "heartbeat_interval_ms = 30000",
    );
    let mut outboxd = Outboxd::with_checkpoint("eos-set", &body, CHECKPOINT);
    outboxd.start();
    insert_rows(&db, 0, 100, 1);
    consume_as(&broker, "read_committed", |all| distinct(all) >= 100);
    // Rows 100..150 go into a transaction that stays open.
    insert_rows(&db, 100, 150, 1);
    let written = consume_as(&broker, "read_uncommitted", |all| distinct(all) >= 150);
    assert_eq!(distinct(&written), 150);
    kill(outboxd.pid(), Signal::SIGSTOP).unwrap();
    let start = committed_checkpoints(&broker, "eos-set")[0].1["position"]["gtid_set"]
        .as_str()
        .unwrap()
        .to_string();
    let target = format!("gtid:{start}");
    let mut set = (false, String::new());
    wait_until(
        "checkpoint set to accept the frozen leader as stopped",
        Duration::from_secs(60),
        || {
            set = output(&outboxd, &["checkpoint", "set", &target]);
            set.0
        },
    );
    kill(outboxd.pid(), Signal::SIGCONT).unwrap();
    wait_until(
        "the woken leader to give up its session",
        Duration::from_secs(60),
        || outboxd.log().contains("lost the pipeline's lead"),
    );
    // Everything is sent again from the start: rows 0..100 (committed before the freeze) twice.
    let again = |all: &[Consumed]| {
        let mut count: std::collections::HashMap<u64, usize> = Default::default();
        for r in all {
            *count.entry(n_of(r)).or_default() += 1;
        }
        count.len() >= 150 && (0..100).all(|n| count.get(&n) >= Some(&2))
    };
    let records = consume_as(&broker, "read_committed", again);
    assert!(
        again(&records),
        "rows 0..100 were not all sent again after `checkpoint set {target}` ({} records): the woken leader committed over it\n{}",
        records.len(),
        outboxd.log()
    );
    check_records_by(&records, 0..150, |n| event(n).3);
    outboxd.stop();
}

/// Two pipelines share the checkpoint topic. One crashes inside its commit, leaving a transaction
/// open on the topic's partition; the other commits checkpoints above it, is killed and restarts.
/// A read_committed reader ends at that open transaction, so a restart that read only that far
/// would resume from an older checkpoint and send its rows twice; before the checkpoint's index
/// the restart waited until the open transaction ended. The index names the newest checkpoint
/// record, committed, so the restart reads it at once and sends nothing twice.
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_restart_reads_its_checkpoint_past_another_pipelines_open_transaction() {
    use outboxd::fault::BEFORE_TRANSACTION_COMMIT;
    let (db, broker) = mariadb_and_broker();
    for topic in ["y.order", "y.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let mut x = mariadb_outboxd(&db, &broker, "eos-x", EXACTLY_ONCE, "");
    let y_body = config_body(&db.cdc_url(), &broker.bootstrap(), EXACTLY_ONCE, "")
        .replace("server_id = 99", "server_id = 98")
        + "[route]\ntopic = \"y.${routedByValue}\"\n";
    let mut y = Outboxd::with_checkpoint("eos-y", &y_body, CHECKPOINT);
    x.start();
    y.start_with_env(
        &[],
        &[("FAILPOINTS", &format!("{BEFORE_TRANSACTION_COMMIT}=return"))],
    );
    insert_rows(&db, 0, 100, 1);
    assert!(!y.wait_exit(LIMIT).success(), "{}", y.log());
    // X commits checkpoints above Y's open transaction.
    insert_rows(&db, 100, 200, 1);
    consume_as(&broker, "read_committed", |all| distinct(all) >= 200);
    x.kill9();
    x.start();
    insert_rows(&db, 200, 250, 1);
    let records = assert_exactly_once(&broker, &mut x, 250, |n| event(n).3);
    let log = x.log();
    assert!(
        !log.contains("waiting for a transaction open on the checkpoint topic"),
        "{log}"
    );
    println!(
        "exactly-once, a pipeline restarted while another's transaction was open on the checkpoint topic: {} records for 250 rows",
        records.len()
    );
    y.start();
    y.stop();
}

/// A record the broker refuses for good inside a Kafka transaction stops outboxd with the remedy
/// (the commit's own failure, "abort and retry", must not turn it into a reconnect loop).
#[test]
fn a_record_the_broker_refuses_stops_with_the_remedy_instead_of_looping() {
    let (db, broker) = mariadb_and_broker();
    let mut outboxd = mariadb_outboxd(
        &db,
        &broker,
        "eos-refused",
        // Every source transaction commits at once: the commit meets the refusal first.
        &format!("{EXACTLY_ONCE}\ntransaction_max_records = 1\n[kafka.properties]\n\"message.max.bytes\" = \"20000000\"\n"),
        "",
    );
    outboxd.start();
    insert_rows(&db, 0, 10, 1);
    let big = "x".repeat(2 * 1024 * 1024);
    db.sql_socket(&format!(
        "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES (UNHEX('{:032x}'), 'order', 'k', 'Big', '{big}');",
        10
    ));
    let status = outboxd.wait_exit(LIMIT);
    assert!(!status.success());
    let log = outboxd.log();
    assert!(log.contains("max.message.bytes"), "{log}");
    assert!(!log.contains("reconnecting"), "{log}");
}

/// Another producer takes the pipeline's records transactional id while the leader sends (what a
/// standby's session start does). librdkafka then fails the leader's records in flight with a
/// bare `Fatal`, which read as a passing delivery failure: the leader reconnected, and its new
/// session's `init_transactions` fenced the instance that had taken over (in the 60-minute soak,
/// two instances did this to each other after every simultaneous start). The fence must read as
/// one: the leader gives up its lead instead of reconnecting, and no row is lost or doubled.
#[test]
fn a_fenced_leader_stands_by_instead_of_fencing_the_new_one_back() {
    use rdkafka::producer::{BaseProducer, Producer};
    let (db, broker) = mariadb_and_broker();
    let mut outboxd = mariadb_outboxd(&db, &broker, "eos-fenced", EXACTLY_ONCE, "");
    outboxd.start();
    insert_rows(&db, 0, 1_000, 7);
    consume_as(&broker, "read_committed", |all| distinct(all) >= 1_000);
    // The fence: what a new leader's session does first. The leader learns of it when it sends
    // the next rows (adding a partition to its next transaction is refused).
    let other: BaseProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("transactional.id", "outboxd.eos-fenced.records")
        .create()
        .unwrap();
    other.init_transactions(Duration::from_secs(30)).unwrap();
    let total = 3_000u64;
    let writer = spawn_writer_from(db.socket_path(), 1_000, total, &[1, 7, 50], 10);
    wait_until("the fenced leader to give up its lead", LIMIT, || {
        outboxd.log().contains("giving up the lead")
            || outboxd
                .log()
                .contains("reconnecting from the last checkpoint")
    });
    let log = outboxd.log();
    assert!(
        !log.contains("reconnecting from the last checkpoint"),
        "the fenced leader reconnected (its next session fences the new leader back):\n{log}"
    );
    assert!(log.contains("this producer was fenced"), "{log}");
    drop(other);
    writer.join().unwrap();
    // Alone, it takes the lead again once its own lease lapses, and sends every row once.
    let records = assert_exactly_once(&broker, &mut outboxd, total, |n| event(n).3);
    assert!(outboxd.log().matches("leading the pipeline").count() >= 2);
    println!(
        "fenced leader: {} records read_committed for {total} rows",
        records.len()
    );
}
