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
use super::rig::{create_topic, wait_until, Broker, Mysqld, Outboxd, Postgres};
use super::{
    at_gtid, gtid_pos, latency, load_script, median, peer_cpu, peer_cpu_since, pg_load_script,
    process_stats, timed_run, topic_end, topic_probe, ProcessStats, Row, PEERS, REPEATS, TOPIC,
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
pub fn section(db: &Mysqld, from: u64, n: u64, record_bytes: u64) -> (Vec<Row>, u64) {
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
                (topic_end(&probe, TOPIC) >= end).then(Instant::now)
            }));
        }
        *PEERS.lock().unwrap() = saved_peers;
        rows.extend(rows_of(
            [
                ("dbz-outboxd", format!("outboxd, MariaDB backlog drain, {per_txn}-row transactions (beside Debezium)"), ours),
                ("dbz-debezium", format!("Debezium 3.5.0 + Connect 4.1.1 standalone, the same MariaDB backlog, {per_txn}-row transactions"), theirs),
            ],
            n,
            record_bytes,
        ));
    }
    (rows, loaded)
}

/// The rates Debezium's latency is measured at (events/s, 1-row transactions).
const LATENCY_RATES: [u64; 2] = [1_000, 5_000];

/// Debezium's commit→consume latency on MariaDB at [`LATENCY_RATES`], measured as outboxd's is
/// (`latency::at_rate`: database-clock stamps, the broker's append times), with the throughput
/// tuning above (`poll.interval.ms` 50, `linger.ms` 5), into a LogAppendTime topic of `broker`.
/// `first` is the next row's sequence number; returns the rows and the one after.
pub fn latency(
    rt: &tokio::runtime::Runtime,
    db: &Mysqld,
    broker: &Broker,
    quick: bool,
    first: u64,
) -> (Vec<latency::Latency>, u64) {
    let connector = Connector::mariadb("dbzlatency", db, 6100, "app.outbox", "dbzlatency");
    let target = latency::Target {
        pg_url: None,
        db_pid: db.pid(),
        broker,
        topic: "dbzlatency.order",
        http_port: 0,
    };
    latency_of(rt, connector, &target, quick, first)
}

/// The same on Postgres (`pgoutput`, a slot of its own), the loader writing through `url`.
pub fn pg_latency(
    rt: &tokio::runtime::Runtime,
    pg: &Postgres,
    url: &str,
    broker: &Broker,
    quick: bool,
    first: u64,
) -> (Vec<latency::Latency>, u64) {
    let connector = Connector::postgres(
        "dbzlatency",
        pg,
        "dbzlatency",
        "public.outbox",
        "dbzlatency",
    );
    let target = latency::Target {
        pg_url: Some(url),
        db_pid: pg.postmaster_pid().expect("postmaster.pid").as_raw(),
        broker,
        topic: "dbzlatency.pgbench",
        http_port: 0,
    };
    latency_of(rt, connector, &target, quick, first)
}

/// Starts a worker with `connector` (tuned as above) into `target`'s topic, measures it at
/// [`LATENCY_RATES`] after an unrecorded warm-up run, and stops it.
fn latency_of(
    rt: &tokio::runtime::Runtime,
    connector: Connector,
    target: &latency::Target<'_>,
    quick: bool,
    mut first: u64,
) -> (Vec<latency::Latency>, u64) {
    latency::create_topic(&target.broker.bootstrap(), target.topic);
    let connector = TUNING.iter().fold(connector, |c, (k, v)| c.with(k, v));
    let mut connect = Connect::start_with(&target.broker.bootstrap(), vec![connector], WORKER);
    let settings = latency::Settings {
        label: "Debezium 3.5 (poll.interval.ms 50, linger.ms 5)",
        kafka: "",
    };
    let pid = connect.pid().expect("the worker runs");
    let seconds = if quick { 5 } else { 20 };
    let mut rows = Vec::new();
    // A first, unrecorded run warms the JVM up, as for outboxd.
    for (i, rate) in std::iter::once(5_000).chain(LATENCY_RATES).enumerate() {
        let seconds = if i == 0 { 3 } else { seconds };
        let row = latency::at_rate(rt, target, pid, None, settings, rate, seconds, first);
        first += rate * seconds;
        if i > 0 {
            rows.push(row);
        }
    }
    connect.stop();
    (rows, first)
}

/// Starts the worker, waits until `arrived` names the moment the last record arrived, stops it:
/// (seconds from start to that moment, JVM stats).
fn timed_drain(
    connect: &mut Connect,
    mut arrived: impl FnMut() -> Option<Instant>,
) -> (f64, ProcessStats) {
    let peers_before = peer_cpu();
    let start = Instant::now();
    let pid = connect.spawn();
    let mut stats = process_stats(pid);
    let mut streaming = None;
    let mut last = None;
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
            last = arrived();
            last.is_some()
        },
    );
    let seconds = (last.unwrap() - start).as_secs_f64();
    stats.peers_cpu = peer_cpu_since(&peers_before);
    stats.open_seconds = streaming.unwrap_or(seconds);
    connect.stop();
    (seconds, stats)
}

/// The same on Postgres (`pgoutput`): a slot only moves forward, so each repeat drains the backlog
/// with a Debezium worker and an outboxd pipeline of its own (own slot, publication, offsets or
/// checkpoint), all started, streaming and stopped before the backlog is written.
pub fn postgres_section(n: u64, record_bytes: u64) -> Vec<Row> {
    let pg = Postgres::start(&["max_replication_slots = 30", "max_wal_senders = 30"]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql(
        "app",
        "CREATE TABLE public.outbox (id uuid PRIMARY KEY, aggregatetype text, aggregateid text, type text, payload jsonb);",
    );
    let postmaster = pg.postmaster_pid().expect("postmaster.pid").as_raw();
    let mut rows = Vec::new();
    let mut loaded = 0;
    for per_txn in [1u64, 10, 100] {
        let broker = Broker::start();
        let saved_peers = std::mem::replace(
            &mut *PEERS.lock().unwrap(),
            vec![("Postgres", postmaster), ("broker", broker.pid())],
        );
        let probe = topic_probe(&broker);
        let mut workers = Vec::new();
        let mut pipelines = Vec::new();
        for rep in 0..REPEATS {
            // A topic per run: each counts exactly what one tool forwarded (the warm-up row, and
            // once more if a stop left it unconfirmed), so the end is "n more than the warm-up".
            let slot = format!("dbz{per_txn}r{rep}");
            create_topic(&broker.bootstrap(), &format!("{slot}.order"), 6);
            let connector = TUNING.iter().fold(
                Connector::postgres(&slot, &pg, &slot, "public.outbox", &slot),
                |c, (k, v)| c.with(k, v),
            );
            workers.push(Connect::start_with(
                &broker.bootstrap(),
                vec![connector],
                WORKER,
            ));
            let name = format!("ob{per_txn}r{rep}");
            create_topic(&broker.bootstrap(), &format!("{name}.order"), 6);
            let body = format!(
                "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\n\
                 slot = \"{name}\"\npublication = \"{name}\"\n[kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"\"\n\
                 [route]\ntopic = \"{name}.${{routedByValue}}\"\n",
                pg.url("debezium", "app"),
                broker.bootstrap()
            );
            let mut outboxd = Outboxd::new(&name, &body);
            outboxd.start();
            pipelines.push(outboxd);
        }
        // One row each forwards gives every worker and pipeline a position to resume from.
        pg.sql("app", &pg_load_script(loaded, loaded + 1, 1, "order"));
        loaded += 1;
        let topics: Vec<(String, String)> = (0..REPEATS)
            .map(|rep| {
                (
                    format!("ob{per_txn}r{rep}.order"),
                    format!("dbz{per_txn}r{rep}.order"),
                )
            })
            .collect();
        wait_until(
            "the warm-up row from each",
            Duration::from_secs(120),
            || {
                topics
                    .iter()
                    .all(|(a, b)| topic_end(&probe, a) >= 1 && topic_end(&probe, b) >= 1)
            },
        );
        for w in &mut workers {
            w.stop();
        }
        for p in &mut pipelines {
            p.stop();
        }
        pg.sql("app", &pg_load_script(loaded, loaded + n, per_txn, "order"));
        loaded += n;
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        let mut short = Vec::new();
        for ((outboxd, connect), (ours_topic, theirs_topic)) in
            pipelines.iter_mut().zip(&mut workers).zip(&topics)
        {
            ours.push(timed_run(
                outboxd,
                "outboxd to drain the Postgres backlog beside Debezium",
                |_| topic_end(&probe, ours_topic) > n,
            ));
            theirs.push(timed_drain(connect, drained(&probe, theirs_topic, n)));
            let (a, b) = (
                topic_end(&probe, ours_topic),
                topic_end(&probe, theirs_topic),
            );
            if a <= n || b <= n {
                short.push(format!(
                    "run {}: outboxd {a}, Debezium {b} of 1 + {n}",
                    ours.len()
                ));
            }
        }
        *PEERS.lock().unwrap() = saved_peers;
        if !short.is_empty() {
            eprintln!(
                "Postgres {per_txn}-row runs that forwarded less than the backlog: {short:?}"
            );
        }
        rows.extend(rows_of(
            [
                ("dbz-pg-outboxd", format!("outboxd, Postgres backlog drain, {per_txn}-row transactions (beside Debezium)"), ours),
                ("dbz-pg-debezium", format!("Debezium 3.5.0 + Connect 4.1.1 standalone, the same Postgres backlog, {per_txn}-row transactions"), theirs),
            ],
            n,
            record_bytes,
        ));
        // Slots hold WAL: drop this size's.
        drop(workers);
        for p in pipelines {
            drop(p);
        }
        pg.sql(
            "app",
            &format!(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                 WHERE slot_name LIKE 'dbz{per_txn}r%' OR slot_name LIKE 'ob{per_txn}r%';"
            ),
        );
    }
    rows
}

/// Done when `topic` holds the warm-up row and `n` more (now), or, for a tool that forwarded
/// fewer (the run reports it), when it has held at least `n` unchanged for 10 s (then: the moment
/// its last record arrived, so the quiet period is not counted).
fn drained<'a>(
    probe: &'a rdkafka::consumer::BaseConsumer,
    topic: &'a str,
    n: u64,
) -> impl FnMut() -> Option<Instant> + 'a {
    let mut last = (0, Instant::now());
    move || {
        let now = topic_end(probe, topic);
        if now != last.0 {
            last = (now, Instant::now());
        }
        if now > n {
            Some(last.1)
        } else {
            (now >= n && last.1.elapsed() > Duration::from_secs(10)).then_some(last.1)
        }
    }
}

/// One tool's timed runs: (row key, what, runs).
type Runs = (&'static str, String, Vec<(f64, ProcessStats)>);

/// The table rows of one comparison, one per tool.
fn rows_of(runs: [Runs; 2], n: u64, record_bytes: u64) -> Vec<Row> {
    runs.into_iter()
        .map(|(key, what, runs)| {
            let (seconds, stats, spread) = median(runs, n);
            Row {
                key,
                what,
                events: n,
                seconds,
                bytes: n * record_bytes,
                extra: format!(
                    "{spread}; {:.1} CPU s ({}), peak RSS {:.0} MB; start→streaming {:.1} s, {:.0} events/s after",
                    stats.cpu_seconds,
                    stats.peers_cpu,
                    stats.peak_rss_mb,
                    stats.open_seconds,
                    n as f64 / (seconds - stats.open_seconds).max(0.001)
                ),
            }
        })
        .collect()
}
