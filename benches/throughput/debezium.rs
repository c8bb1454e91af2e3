//! `--only debezium`: outboxd beside Debezium 3.5 (Kafka Connect standalone, the Outbox Event
//! Router; `scripts/debezium.sh`) draining the same MariaDB backlogs into the same Apache Kafka,
//! interleaved run by run.
//!
//! Debezium is tuned as its docs advise for throughput: a larger batch and queue
//! (`max.batch.size` 8192, `max.queue.size` 32768), a short `poll.interval.ms` (50), and producer
//! batching (`linger.ms` 5, `batch.size` 1 MiB, `acks=all` as Connect sets it); Connect's own JVM
//! defaults (`-Xms256M -Xmx2G`, G1), `StringConverter` for keys and values (the cheapest). Both start
//! from the backlog's beginning each run (Debezium's offsets and schema history put back, outboxd's
//! checkpoint put back); the clock runs from process start until the broker holds every record
//! (Debezium) or the checkpoint names the backlog's end (outboxd: later than its records).

use std::time::{Duration, Instant};

use super::rig::debezium::{Connect, Connector};
use super::rig::scenario::config_body;
use super::rig::{create_topic, wait_until, Broker, MariaDb, Outboxd};
use super::{
    at_gtid, gtid_pos, load_script, median, peer_cpu, peer_cpu_since, process_stats, timed_run,
    topic_end, topic_probe, ProcessStats, Row, PEERS, REPEATS, TOPIC,
};

/// The connector settings Debezium's docs advise for throughput (see the module docs).
const TUNING: &[(&str, &str)] = &[
    ("max.batch.size", "8192"),
    ("max.queue.size", "32768"),
    ("poll.interval.ms", "50"),
];

/// Worker settings: producer batching and Connect's own JVM defaults.
const WORKER: &[(&str, &str)] = &[
    ("producer.linger.ms", "5"),
    ("producer.batch.size", "1048576"),
    ("producer.compression.type", "none"),
];

pub fn settings() -> String {
    TUNING
        .iter()
        .chain(WORKER)
        .map(|(k, v)| format!("`{k}={v}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One transaction size: the backlog of `n` rows from `from`, drained by both REPEATS times.
pub fn section(db: &MariaDb, from: u64, n: u64, record_bytes: u64) -> (Vec<Row>, u64) {
    let mut rows = Vec::new();
    let mut loaded = from;
    std::env::set_var("DEBEZIUM_HEAP_OPTS", "-Xms256M -Xmx2G");
    std::env::set_var(
        "DEBEZIUM_JVM_OPTS",
        "-server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent",
    );
    for per_txn in [1u64, 10, 100] {
        let broker = Broker::start();
        create_topic(&broker.bootstrap(), TOPIC, 6);
        let saved_peers = std::mem::replace(
            &mut *PEERS.lock().unwrap(),
            vec![("MariaDB", db.pid()), ("broker", broker.pid())],
        );
        // Both note the binlog's end, then stop; the backlog is written after.
        let name = format!("dbz{per_txn}");
        let connector = TUNING.iter().fold(
            Connector::mariadb(
                &name,
                db,
                6000 + per_txn as u32,
                "app.outbox",
                "outbox.event",
            ),
            |c, (k, v)| c.with(k, v),
        );
        let history = Connector::mariadb_history(db, &name);
        let mut connect = Connect::start_with(&broker.bootstrap(), vec![connector], WORKER);
        // One row streamed and acked gives Debezium an offset to resume from (a stop right after
        // its no-data snapshot may leave none).
        db.sql_socket(&load_script(loaded, loaded + 1, 1));
        loaded += 1;
        let probe = topic_probe(&broker);
        wait_until("Debezium's warm-up row", Duration::from_secs(120), || {
            topic_end(&probe, TOPIC) >= 1
        });
        connect.stop();
        let saved = [
            (
                connect.offsets_file(),
                std::fs::read(connect.offsets_file()).unwrap(),
            ),
            (history.clone(), std::fs::read(&history).unwrap()),
        ];
        let mut outboxd = Outboxd::new(
            &format!("besidedbz{per_txn}"),
            &config_body(&db.cdc_url(), &broker.bootstrap(), "", ""),
        );
        outboxd.start();
        outboxd.stop();
        let checkpoint = std::fs::read(outboxd.checkpoint_path()).unwrap();
        db.sql_socket(&load_script(loaded, loaded + n, per_txn));
        loaded += n;
        let target = gtid_pos(db);
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        for _ in 0..REPEATS {
            std::fs::write(outboxd.checkpoint_path(), &checkpoint).unwrap();
            ours.push(timed_run(
                &mut outboxd,
                "outboxd to drain the backlog beside Debezium",
                at_gtid(&target),
            ));
            for (path, bytes) in &saved {
                std::fs::write(path, bytes).unwrap();
            }
            let end = topic_end(&probe, TOPIC) + n;
            theirs.push(timed_drain(&mut connect, || {
                topic_end(&probe, TOPIC) >= end
            }));
        }
        *PEERS.lock().unwrap() = saved_peers;
        for (key, what, runs) in [
            (
                "dbz-outboxd",
                format!("outboxd, MariaDB backlog drain, {per_txn}-row transactions (beside Debezium)"),
                ours,
            ),
            (
                "dbz-debezium",
                format!("Debezium 3.5.0 + Connect 4.1.1 standalone, the same backlog, {per_txn}-row transactions"),
                theirs,
            ),
        ] {
            let (seconds, stats, spread) = median(runs, n);
            rows.push(Row {
                key,
                what,
                events: n,
                seconds,
                bytes: n * record_bytes,
                extra: format!(
                    "{spread}; {:.1} CPU s ({}), peak RSS {:.0} MB; start→streaming {:.1} s",
                    stats.cpu_seconds, stats.peers_cpu, stats.peak_rss_mb, stats.open_seconds
                ),
            });
        }
    }
    (rows, loaded)
}

/// Starts the worker, waits until `arrived` holds, stops it: (seconds, JVM stats).
fn timed_drain(connect: &mut Connect, mut arrived: impl FnMut() -> bool) -> (f64, ProcessStats) {
    let peers_before = peer_cpu();
    let start = Instant::now();
    let pid = connect.spawn();
    let mut stats = process_stats(pid);
    let mut streaming = None;
    wait_until(
        "Debezium to drain the backlog",
        Duration::from_secs(1800),
        || {
            assert!(
                !connect.exited(),
                "Kafka Connect exited:\n{}",
                connect.log_tail()
            );
            if streaming.is_none() && connect.streaming() {
                streaming = Some(start.elapsed().as_secs_f64());
            }
            stats = process_stats(pid);
            arrived()
        },
    );
    let seconds = start.elapsed().as_secs_f64();
    stats.peers_cpu = peer_cpu_since(&peers_before);
    stats.open_seconds = streaming.unwrap_or(seconds);
    connect.stop();
    (seconds, stats)
}
