//! Faults on the network path between outboxd and its servers, made in a network namespace of the
//! test's own (`rig::netns`): outboxd runs inside it, MariaDB and Apache Kafka listen on the host end
//! of its veth. Found by the soak (`soak`), each pinned here by a test that failed first.

use std::time::Duration;

use crate::rig::mysqld::CDC_PASSWORD;
use crate::rig::netns::NetNs;
use crate::rig::scenario::{n_of, SCHEMA};
use crate::rig::{consume_to_end, create_topic, wait_until, Broker, Mysqld, Outboxd, ROUND};

/// A row of about `size` bytes with sequence number `n` (id and key as `scenario::event`).
fn insert(n: u64, size: usize) -> String {
    let (id, kind, key, _) = crate::rig::scenario::event(n);
    format!(
        "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES \
         (UNHEX('{id}'), '{kind}', '{key}', 'Created', CONCAT('{{\"n\":{n},\"pad\":\"', REPEAT('x', {size}), '\"}}'));"
    )
}

fn distinct_rows(bootstrap: &str) -> std::collections::BTreeSet<u64> {
    ["outbox.event.order", "outbox.event.customer"]
        .iter()
        .flat_map(|t| consume_to_end(&[("bootstrap.servers", bootstrap)], t, ROUND))
        .map(|r| n_of(&r))
        .collect()
}

/// MariaDB (with `extra` server options) and Apache Kafka on the host end of a fresh namespace's
/// veth, and outboxd (1 s heartbeats) inside it, started.
fn setup(name: &str, extra: &[&str]) -> (NetNs, Mysqld, Broker, Outboxd) {
    let ns = NetNs::create();
    let host = ns.host_ip().to_string();
    let bind = format!("bind-address=127.0.0.1,{host}");
    let mut options = vec![bind.as_str()];
    options.extend_from_slice(extra);
    let db = Mysqld::mariadb(&options);
    db.sql_socket(SCHEMA);
    db.sql_socket(&format!(
        "SET SESSION sql_log_bin = 0; CREATE USER 'cdc'@'{ip}' IDENTIFIED BY '{CDC_PASSWORD}'; \
         GRANT REPLICATION SLAVE, REPLICATION CLIENT, BINLOG MONITOR, SELECT ON *.* TO 'cdc'@'{ip}';",
        ip = ns.ns_ip()
    ));
    let broker = Broker::start_on(&host, "");
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let mut outboxd = Outboxd::new(
        name,
        &format!(
            "[source]\nkind = \"mysql\"\nurl = \"mysql://cdc@{host}:{}/app\"\ntables = [\"app.outbox\"]\n\
             server_id = 99\nheartbeat_interval_ms = 1000\n[kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"\"\n",
            db.port,
            broker.bootstrap()
        ),
    );
    outboxd.wrapper = ns.wrapper();
    outboxd.start();
    (ns, db, broker, outboxd)
}

/// Waits (bounded) until rows `0..count` all arrived; on failure shows the server's threads and
/// outboxd's log.
fn wait_for_rows(db: &Mysqld, broker: &Broker, outboxd: &Outboxd, count: usize, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while distinct_rows(&broker.bootstrap()).len() < count {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} did not arrive within 120 s; processlist:\n{}\noutboxd:\n{}",
            db.sql_socket(
                "SELECT ID, USER, COMMAND, TIME, STATE FROM information_schema.PROCESSLIST;"
            ),
            outboxd.log()
        );
    }
}

/// A partition while MariaDB streams megabytes leaves its dump thread blocked in a write to the
/// dead connection, and MariaDB does not start a new dump for the same replica server id until the
/// old one ends: by itself only after `net_write_timeout` (60 s by default, an hour here). outboxd
/// ends its own previous dump thread (`KILL CONNECTION`, checked to be a binlog dump of its user)
/// before it asks for a new one, so the stream resumes as soon as the network is back.
#[test]
fn after_a_partition_the_previous_dump_thread_is_ended_and_the_stream_resumes() {
    let (ns, db, broker, mut outboxd) = setup("partition", &["net_write_timeout=3600"]);
    let script: String = (0..20).map(|n| insert(n, 100)).collect();
    db.sql_socket(&format!("BEGIN;{script}COMMIT;"));
    wait_until("the first rows", Duration::from_secs(60), || {
        distinct_rows(&broker.bootstrap()).len() == 20
    });

    ns.partition(true);
    // Megabytes the server cannot deliver: its dump thread blocks writing them.
    for n in 20..50 {
        db.sql_socket(&insert(n, 900_000));
    }
    // Long enough that the server's retransmissions to the lost connection back off past many
    // seconds: its dump thread outlives the partition (on its own it would end at the next
    // retransmission, or at net_write_timeout).
    wait_until(
        "outboxd to give the stream up and fail to reconnect twice",
        Duration::from_secs(120),
        || {
            let log = outboxd.log();
            log.contains("treated as dead") && log.matches("session ended").count() >= 3
        },
    );
    ns.partition(false);
    let script: String = (50..60).map(|n| insert(n, 100)).collect();
    db.sql_socket(&format!("BEGIN;{script}COMMIT;"));
    // Bounds the test, not a timing claim: without the fix nothing arrives for an hour.
    wait_for_rows(&db, &broker, &outboxd, 60, "the rows after the partition");
    assert!(
        outboxd
            .log()
            .contains("ended this pipeline's previous binlog dump"),
        "{}",
        outboxd.log()
    );
    outboxd.stop();
}

/// The server sends heartbeats only when it has nothing else to send, so a row that takes longer
/// than three heartbeats to cross a slow link looked like a dead stream: outboxd reconnected from
/// its checkpoint into the same row, again and again, and nothing after it arrived while the link
/// stayed slow (the soak's slow-network fault). Now the silent stream is asked about on the control
/// connection, and a server still sending it is waited for.
#[test]
fn a_row_slower_to_arrive_than_three_heartbeats_is_waited_for_while_the_server_sends_it() {
    let (ns, db, broker, mut outboxd) = setup("slowlink", &[]);
    let script: String = (0..5).map(|n| insert(n, 100)).collect();
    db.sql_socket(&format!("BEGIN;{script}COMMIT;"));
    wait_for_rows(&db, &broker, &outboxd, 5, "the first rows");
    // 256 kbit/s: a 400 kB row takes about 12 s to cross, four times the 3 s outboxd waits for a
    // heartbeat.
    ns.slow(0, 256);
    db.sql_socket(&insert(5, 400_000));
    let script: String = (6..10).map(|n| insert(n, 100)).collect();
    db.sql_socket(&format!("BEGIN;{script}COMMIT;"));
    wait_for_rows(&db, &broker, &outboxd, 10, "the rows behind the large one");
    assert!(
        outboxd
            .log()
            .contains("the server's dump thread for it is alive"),
        "{}",
        outboxd.log()
    );
    assert!(
        !outboxd.log().contains("treated as dead"),
        "outboxd gave a working stream up:\n{}",
        outboxd.log()
    );
    outboxd.stop();
    ns.heal();
}
