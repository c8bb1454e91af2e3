//! outboxd side by side with the machine's raw limits and with a polling relay, in one run.
//!
//! `cargo bench --bench throughput [-- --quick]` (or `./benches/run.sh [--quick]`): starts a private
//! MariaDB and Apache Kafka like the tests do (with Kafka's own JVM defaults), then measures, for the same rows:
//! - outboxd draining a preloaded backlog (transactions of 1, 10 and 100 rows): events/s, MB/s, CPU
//!   seconds and peak RSS of the outboxd process (release build, acks=all, real checkpoint writes);
//! - the raw source limit: `mariadb-binlog --read-from-remote-server` reading the same binlog;
//! - the raw broker limit: librdkafka alone producing the same records with acks=all;
//! - a polling relay (`SELECT … ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED`, produce, DELETE,
//!   COMMIT), written fairly: batched, acks=all, same producer settings;
//! - commit→consume latency at fixed offered rates on MariaDB and Postgres, split into hops
//!   (`latency.rs` says how each is taken), with outboxd's defaults and with `linger.ms = 0`;
//!
//! - the nearest peer, DeltaForge (`--peer deltaforge=PATH`), and outboxd draining one MariaDB
//!   backlog in DeltaForge's outbox shape, interleaved run by run;
//! - exactly-once beside at-least-once (`--only eos`): both with the Kafka checkpoint store, draining
//!   the same backlog to Apache Kafka, interleaved run by run.
//!
//! - the RabbitMQ, NATS and Redis sinks (`--only sinks`): outboxd draining a backlog into each
//!   beside the raw limit of the same client library publishing the same messages with the same
//!   settings (RabbitMQ: persistent, mandatory, confirms, a window of 10,000; NATS: `Nats-Msg-Id`,
//!   every `PubAck` awaited; Redis: `MULTI`/`EXEC` batches of 1,000), interleaved run by run.
//!
//! - the SNS sink (`--only aws`) on moto: outboxd's CPU per 1,000 messages beside the AWS SDK's
//!   alone (`aws.rs` says why SNS and not SQS; moto sets the rate).
//!
//! - Debezium 3.5 under Kafka Connect (`--only debezium`) and outboxd draining the same MariaDB
//!   backlogs (1-, 10- and 100-row transactions) into the same Apache Kafka, interleaved run by run.
//!
//! - `outboxd audit` over 200,000 and 1,000,000 delivered rows (`--only audit`): seconds and peak
//!   RSS, and the memory per row from the difference.
//!
//! It prints a Markdown table for BENCHMARKS.md. Numbers are not asserted anywhere.

// The benchmark borrows the test rig and uses only part of it.
#[allow(dead_code, unused_imports)]
#[path = "../tests/rig/mod.rs"]
mod rig;

#[path = "throughput/audit.rs"]
mod audit;

#[path = "throughput/aws.rs"]
mod aws;

#[path = "throughput/checkpoint_scan.rs"]
mod checkpoint_scan;

#[path = "throughput/debezium.rs"]
mod debezium;

#[path = "throughput/latency.rs"]
mod latency;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mysql_async::prelude::Queryable;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, BaseRecord, FutureProducer, FutureRecord, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use rig::scenario::{config_body, transactions, uuid_of, SCHEMA};
use rig::{create_topic, wait_until, Broker, Mysqld, Outboxd, Postgres};

const KEYS: u64 = 1000;
const TOPIC: &str = "outbox.event.order";

fn payload(n: u64, stamp_micros: u128) -> String {
    // ~300 bytes of JSON.
    format!(
        r#"{{"n":{n},"t":{stamp_micros},"order":{{"id":"o-{n}","customer":"c-{}","lines":[{{"sku":"SKU-0001","qty":2,"price":"12.50"}},{{"sku":"SKU-0002","qty":1,"price":"7.25"}}],"note":"{}"}}}}"#,
        n % KEYS,
        "x".repeat(120)
    )
}

/// `INSERT`s of rows `from..to` in transactions of `per_txn` rows (multi-row statements).
fn load_script(from: u64, to: u64, per_txn: u64) -> String {
    let mut script = String::new();
    let mut n = from;
    while n < to {
        let end = (n + per_txn).min(to);
        let values: Vec<String> = (n..end)
            .map(|m| {
                format!(
                    "(UNHEX('{m:032x}'),'order','key-{}','Created','{}')",
                    m % KEYS,
                    payload(m, 0)
                )
            })
            .collect();
        script.push_str(&format!(
            "BEGIN;INSERT INTO app.outbox (id,aggregatetype,aggregateid,type,payload) VALUES {};COMMIT;\n",
            values.join(",")
        ));
        n = end;
    }
    script
}

/// The same for Postgres's `public.outbox` (uuid ids), routed by `kind`.
fn pg_load_script(from: u64, to: u64, per_txn: u64, kind: &str) -> String {
    let mut script = String::new();
    let mut m = from;
    while m < to {
        let values: Vec<String> = (m..(m + per_txn).min(to))
            .map(|k| {
                format!(
                    "('{}','{kind}','key-{}','Created','{}')",
                    uuid_of(k),
                    k % KEYS,
                    payload(k, 0)
                )
            })
            .collect();
        script.push_str(&format!(
            "BEGIN;INSERT INTO public.outbox (id,aggregatetype,aggregateid,type,payload) VALUES {};COMMIT;\n",
            values.join(",")
        ));
        m += per_txn;
    }
    script
}

struct ProcessStats {
    cpu_seconds: f64,
    peak_rss_mb: f64,
    /// Process start to "stream opened" in its log (connect, preflight, dump request); part of the
    /// timed run.
    open_seconds: f64,
    /// CPU seconds the servers (database, broker) spent during the run: they share the two cores.
    peers_cpu: String,
    /// The same, summed: with outboxd's own, how busy the machine's cores were.
    peers_cpu_seconds: f64,
    /// outboxd's three busiest threads and their CPU seconds (which one is the limit).
    threads: String,
    /// Context switches of all its threads (voluntary + involuntary): the wake-ups it paid.
    switches: u64,
}

/// The server processes sharing the machine with outboxd: (name, pid).
static PEERS: std::sync::Mutex<Vec<(&'static str, i32)>> = std::sync::Mutex::new(Vec::new());

fn peer_cpu() -> Vec<(&'static str, f64)> {
    PEERS
        .lock()
        .unwrap()
        .iter()
        .map(|(name, pid)| {
            let cpu = match *name {
                "Postgres" => postgres_cpu_seconds(*pid),
                _ => process_stats(*pid).cpu_seconds,
            };
            (*name, cpu)
        })
        .collect()
}

/// CPU seconds of a postmaster and all its backends, the ones that exited included (the
/// postmaster waited for them: `cutime + cstime`).
fn postgres_cpu_seconds(postmaster: i32) -> f64 {
    tree_cpu_seconds(postmaster) + stat_cpu_seconds(&postmaster.to_string(), true)
}

/// CPU seconds from `/proc/<pid>/stat` (`pid` may be `self`): the process's own (`utime + stime`),
/// or with `children` those of the children it waited for (`cutime + cstime`).
fn stat_cpu_seconds(pid: &str, children: bool) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let first = if children { 13 } else { 11 };
    let ticks: f64 = (first..first + 2)
        .map(|i| {
            fields
                .get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        })
        .sum();
    ticks / 100.0
}

fn peer_cpu_since(before: &[(&'static str, f64)]) -> String {
    peer_cpu()
        .iter()
        .zip(before)
        .map(|((name, after), (_, before))| format!("{name} {:.1}", after - before))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A drain's start, its rate after the stream opened, how busy the machine's cores were and
/// outboxd's busiest threads.
fn where_the_time_went(stats: &ProcessStats, n: u64, seconds: f64) -> String {
    format!(
        "{:.2} s of it to open the stream ({:.0} events/s after it); cores busy {:.2} of {}; busiest threads: {}",
        stats.open_seconds,
        n as f64 / (seconds - stats.open_seconds).max(0.001),
        (stats.cpu_seconds + stats.peers_cpu_seconds) / seconds,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        stats.threads
    )
}

/// The servers' CPU seconds since `before`, summed.
fn peer_cpu_seconds_since(before: &[(&'static str, f64)]) -> f64 {
    peer_cpu()
        .iter()
        .zip(before)
        .map(|((_, after), (_, before))| after - before)
        .sum()
}

/// The busiest threads of `pid` (by `/proc/<pid>/task/*/stat`): "name CPU s", three at most.
fn busiest_threads(pid: i32) -> String {
    let mut threads: Vec<(String, f64)> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|task| {
            let tid = task.file_name().to_string_lossy().to_string();
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            let name = stat.split_once('(')?.1.rsplit_once(')')?.0.to_string();
            Some((name, stat_cpu_seconds(&format!("{pid}/task/{tid}"), false)))
        })
        .collect();
    threads.sort_by(|a, b| b.1.total_cmp(&a.1));
    threads
        .iter()
        .take(3)
        .map(|(name, cpu)| format!("{name} {cpu:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn process_stats(pid: i32) -> ProcessStats {
    let cpu_seconds = stat_cpu_seconds(&pid.to_string(), false);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm_kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    let switches = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|l| l.ends_with("ctxt_switches") || l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum();
    ProcessStats {
        cpu_seconds,
        peak_rss_mb: hwm_kb / 1024.0,
        open_seconds: 0.0,
        peers_cpu: String::new(),
        peers_cpu_seconds: 0.0,
        threads: busiest_threads(pid),
        switches,
    }
}

/// Starts outboxd, waits until `done(outboxd)` holds, stops it: (seconds, process stats at the end).
fn timed_run(
    outboxd: &mut Outboxd,
    what: &str,
    mut done: impl FnMut(&Outboxd) -> bool,
) -> (f64, ProcessStats) {
    let peers_before = peer_cpu();
    let start = Instant::now();
    outboxd.start();
    let open_seconds = start.elapsed().as_secs_f64();
    let pid = outboxd.pid().as_raw();
    let perf = profile_dir().map(|dir| {
        let label: String = what
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let data = format!("{dir}/{label}-{pid}.perf.data");
        eprintln!("profiling outboxd (pid {pid}) into {data}");
        Command::new("perf")
            .args(["record", "-F", "997", "--call-graph", "dwarf,16384"])
            .args(["-o", &data, "-p", &pid.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("perf is installed (--profile)")
    });
    let mut stats = process_stats(pid);
    wait_until(what, Duration::from_secs(1800), || {
        stats = process_stats(pid);
        done(outboxd)
    });
    let seconds = start.elapsed().as_secs_f64();
    if let Some(mut perf) = perf {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(perf.id() as i32),
            nix::sys::signal::Signal::SIGINT,
        );
        let _ = perf.wait();
    }
    stats.peers_cpu = peer_cpu_since(&peers_before);
    stats.peers_cpu_seconds = peer_cpu_seconds_since(&peers_before);
    outboxd.stop();
    stats.open_seconds = open_seconds;
    (seconds, stats)
}

/// Starts and stops `outboxd` once, so that it saves a checkpoint at the current end of the
/// binlog (before the backlog is loaded); returns that checkpoint, to restore before each run.
fn first_checkpoint(outboxd: &mut Outboxd) -> Vec<u8> {
    outboxd.start();
    outboxd.stop();
    std::fs::read(outboxd.checkpoint_path()).unwrap()
}

/// `done` for [`timed_run`]: the checkpoint reached MariaDB GTID state `target`.
fn at_gtid(target: &str) -> impl FnMut(&Outboxd) -> bool + '_ {
    move |o| o.checkpoint_or_null()["position"]["gtid_set"] == target
}

/// Command-line switches of the benchmark (after `--`).
struct Args {
    quick: bool,
    /// `--profile DIR`: every timed outboxd run is recorded by `perf record -g` into DIR.
    profile: Option<String>,
    /// `--only a,b`: run only these sections (drain, huge, raw, relay, postgres, latency, restart,
    /// eos, peer, sinks, aws, checkpoint, audit).
    only: Option<Vec<String>>,
    /// `--baseline PATH[=LABEL]`: also drain every backlog with this outboxd binary (an older
    /// build), interleaved with this build's runs, for a before/after in one run.
    baseline: Option<(std::path::PathBuf, String)>,
    /// `--peer deltaforge=PATH`: also drain a backlog with this DeltaForge binary (the `peer`
    /// section; built outside the repository, see BENCHMARKS.md).
    peer: Option<std::path::PathBuf>,
    /// `--pg-majors 15,18`: the PostgreSQL majors the `postgres` section drains, one after the
    /// other in the same run (default 15; the latency series runs on the first).
    pg_majors: Vec<u32>,
}

impl Args {
    fn parse() -> Args {
        let args: Vec<String> = std::env::args().collect();
        let value = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .and_then(|i| args.get(i + 1).cloned())
        };
        Args {
            quick: args.iter().any(|a| a == "--quick"),
            profile: value("--profile"),
            only: value("--only").map(|v| v.split(',').map(str::to_string).collect()),
            baseline: value("--baseline").map(|v| match v.split_once('=') {
                Some((path, label)) => (path.into(), label.to_string()),
                None => (v.clone().into(), "baseline".to_string()),
            }),
            peer: value("--peer").map(|v| match v.split_once('=') {
                Some(("deltaforge", path)) => path.into(),
                _ => panic!("--peer takes deltaforge=PATH (the only peer measured)"),
            }),
            pg_majors: value("--pg-majors")
                .map(|v| {
                    v.split(',')
                        .map(|m| {
                            m.trim()
                                .parse()
                                .expect("--pg-majors takes majors like 15,18")
                        })
                        .collect()
                })
                .unwrap_or_else(|| vec![15]),
        }
    }

    fn wants(&self, section: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|only| only.iter().any(|s| s == section))
    }
}

fn profile_dir() -> Option<String> {
    Args::parse().profile
}

/// "outboxd", or "outboxd LABEL" for the `--baseline` build.
fn build_label(baseline: Option<&str>) -> String {
    match baseline {
        Some(label) => format!("outboxd {label}"),
        None => "outboxd".to_string(),
    }
}

/// One line of the throughput table; `key` finds it again for the ratios.
struct Row {
    key: &'static str,
    what: String,
    events: u64,
    seconds: f64,
    bytes: u64,
    extra: String,
}

impl Row {
    fn rate(&self) -> f64 {
        self.events as f64 / self.seconds
    }
}

fn main() {
    let args = Args::parse();
    let quick = args.quick;
    let n: u64 = if quick { 20_000 } else { 200_000 };
    let record_bytes = payload(0, 0).len() as u64 + 40;
    // Sized like a small production server rather than the tests' minimal one: with a 64 MB buffer
    // pool the growing outbox table makes InnoDB stall commits, which the latency would then measure.
    let db = Mysqld::mariadb(&[
        "binlog-row-metadata=FULL",
        "innodb-buffer-pool-size=1G",
        "innodb-log-file-size=512M",
    ]);
    db.sql_socket(SCHEMA);
    let broker = Broker::start();
    create_topic(&broker.bootstrap(), TOPIC, 6);
    PEERS
        .lock()
        .unwrap()
        .extend([("MariaDB", db.pid()), ("broker", broker.pid())]);
    *latency::ROOT_URL.lock().unwrap() = format!("mysql://root@127.0.0.1:{}/", db.port);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut rows: Vec<Row> = Vec::new();

    // outboxd, backlog drain, per transaction size. The rows are loaded even when the drain itself is
    // not measured: the raw source and the relay read them too.
    let mut outboxd = Outboxd::new(
        "bench",
        &config_body(&db.cdc_url(), &broker.bootstrap(), "", ""),
    );
    outboxd.start();
    outboxd.stop();
    // The other drainers read the same binlog from the same start, each with its own checkpoint:
    // this build with the low-latency settings (what they cost in throughput), and the baseline
    // build if one was given.
    let mut others: Vec<(String, Outboxd, [&'static str; 3])> = Vec::new();
    if args.wants("drain") {
        let low = Outboxd::new(
            "benchlow",
            &config_body(&db.cdc_url(), &broker.bootstrap(), latency::LOW_LATENCY, ""),
        );
        others.push((
            "outboxd with linger.ms = 0".into(),
            low,
            ["low-drain1", "low-drain10", "low-drain100"],
        ));
    }
    if let Some((path, label)) = &args.baseline {
        let mut base = Outboxd::new(
            "benchbase",
            &config_body(&db.cdc_url(), &broker.bootstrap(), "", ""),
        );
        base.binary = path.clone();
        others.push((
            build_label(Some(label)),
            base,
            ["base-drain1", "base-drain10", "base-drain100"],
        ));
    }
    for (_, other, _) in &mut others {
        other.start();
        other.stop();
    }
    let mut loaded = 0;
    let mut binlogs = Vec::new();
    // The MariaDB backlogs are loaded when a section reads them.
    let mariadb_backlog = ["drain", "huge", "raw", "relay"]
        .iter()
        .any(|s| args.wants(s));
    for (per_txn, key) in [(1u64, "drain1"), (10, "drain10"), (100, "drain100")] {
        if !mariadb_backlog {
            break;
        }
        db.sql_socket("FLUSH BINARY LOGS;");
        let file = db
            .sql_socket("SHOW MASTER STATUS;")
            .split('\t')
            .next()
            .unwrap()
            .to_string();
        db.sql_socket(&load_script(loaded, loaded + n, per_txn));
        loaded += n;
        binlogs.push((per_txn, file));
        if !args.wants("drain") {
            continue;
        }
        let target = gtid_pos(&db);
        // The same backlog drained REPEATS times (the checkpoint put back before each run), and as
        // often by each other drainer, interleaved run by run.
        let size = match per_txn {
            1 => 0,
            10 => 1,
            _ => 2,
        };
        let checkpoint = std::fs::read(outboxd.checkpoint_path()).unwrap();
        let saved: Vec<Vec<u8>> = others
            .iter()
            .map(|(_, other, _)| std::fs::read(other.checkpoint_path()).unwrap())
            .collect();
        let mut runs: Vec<(f64, ProcessStats)> = Vec::new();
        let mut other_runs: Vec<Vec<(f64, ProcessStats)>> =
            others.iter().map(|_| Vec::new()).collect();
        for _ in 0..REPEATS {
            for (((label, other, _), saved), runs) in
                others.iter_mut().zip(&saved).zip(&mut other_runs)
            {
                std::fs::write(other.checkpoint_path(), saved).unwrap();
                runs.push(timed_run(
                    other,
                    &format!("{label} to drain the backlog"),
                    at_gtid(&target),
                ));
            }
            std::fs::write(outboxd.checkpoint_path(), &checkpoint).unwrap();
            runs.push(timed_run(
                &mut outboxd,
                "outboxd to drain the backlog",
                at_gtid(&target),
            ));
        }
        let drained = std::iter::once((build_label(None), runs, key)).chain(
            others
                .iter()
                .zip(other_runs)
                .map(|((label, _, keys), runs)| (label.clone(), runs, keys[size])),
        );
        for (who, runs, row_key) in drained {
            let (seconds, stats, spread) = median(runs, n);
            rows.push(Row {
                key: row_key,
                what: format!("{who}, MariaDB backlog drain, {per_txn}-row transactions"),
                events: n,
                seconds,
                bytes: n * record_bytes,
                extra: format!(
                    "{spread}; {:.1} CPU s ({} CPU s), {:.1} context switches per 100 rows, peak RSS {:.0} MB, {}",
                    stats.cpu_seconds, stats.peers_cpu, stats.switches as f64 * 100.0 / n as f64, stats.peak_rss_mb,
                    where_the_time_went(&stats, n, seconds)
                ),
            });
        }
    }

    // One huge transaction: memory must not grow with it (rows are streamed, never buffered).
    if args.wants("huge") {
        let huge = if quick { 100_000u64 } else { 1_000_000 };
        db.sql_socket(&format!(
            "INSERT INTO app.outbox (id,aggregatetype,aggregateid,type,payload) \
             SELECT UNHEX(LPAD(HEX(seq + 100000000), 32, '0')), 'huge', CONCAT('key-', seq % {KEYS}), 'Created', REPEAT('x', 250) \
             FROM app.seq_1_to_{huge};"
        ));
        let target = gtid_pos(&db);
        let (seconds, stats) = timed_run(
            &mut outboxd,
            "outboxd to pass the huge transaction",
            at_gtid(&target),
        );
        rows.push(Row {
            key: "huge",
            what: format!("outboxd, one {huge}-row transaction"),
            events: huge,
            seconds,
            bytes: huge * 300,
            extra: format!(
                "peak RSS {:.0} MB (flat: rows are streamed)",
                stats.peak_rss_mb
            ),
        });
    }

    if args.wants("raw") {
        rows.push(median_row(
            (0..REPEATS)
                .map(|_| raw_source(&db, &binlogs[1].1, n, record_bytes))
                .collect(),
        ));
        rows.push(median_row(
            (0..REPEATS)
                .map(|_| rt.block_on(raw_broker(&broker, n, record_bytes)))
                .collect(),
        ));
    }

    // Polling relay over the rows of the 10-row load (deleting them as it goes).
    if args.wants("relay") {
        db.sql_socket(&format!(
            "DELETE FROM app.outbox WHERE id < UNHEX('{:032x}') OR id >= UNHEX('{:032x}');",
            n,
            2 * n
        ));
        let (relayed, queries, seconds) = rt.block_on(polling_relay(&db, &broker));
        rows.push(Row {
            key: "relay",
            what:
                "polling relay: SELECT … LIMIT 500 FOR UPDATE SKIP LOCKED, produce, DELETE, COMMIT"
                    .into(),
            events: relayed,
            seconds,
            bytes: relayed * record_bytes,
            extra: format!("{queries} queries"),
        });
    }

    if args.wants("eos") {
        rows.extend(exactly_once_section(
            &db,
            loaded,
            n,
            record_bytes,
            args.baseline.as_ref(),
        ));
        loaded += n;
    }

    // `sinks` runs all three; `rabbitmq`, `nats` or `redis` one of them.
    let sink = |name: &str| {
        args.wants("sinks")
            || args
                .only
                .as_ref()
                .is_some_and(|o| o.iter().any(|s| s == name))
    };
    if sink("rabbitmq") {
        rows.extend(rabbitmq_section(&db, &rt, loaded, n, record_bytes));
        loaded += n;
    }
    if sink("nats") {
        rows.extend(nats_section(&db, &rt, loaded, n, record_bytes));
        loaded += n;
    }
    if sink("redis") {
        rows.extend(redis_section(&db, &rt, loaded, n, record_bytes));
        loaded += n;
    }
    if args.wants("aws") {
        let aws_rows = aws::rows(quick);
        rows.extend(aws::section(&db, &rt, loaded, aws_rows, record_bytes));
        loaded += aws_rows;
    }

    if args.wants("debezium") {
        let (dbz_rows, now_loaded) = debezium::section(&db, loaded, n, record_bytes);
        rows.extend(dbz_rows);
        loaded = now_loaded;
        rows.extend(debezium::postgres_section(n, record_bytes));
        eprintln!("Debezium's settings: {}", debezium::settings());
    }

    if let Some(binary) = args.peer.as_ref().filter(|_| args.wants("peer")) {
        rows.extend(peer_section(&db, binary, n, record_bytes));
        rows.extend(peer_postgres_section(binary, n, record_bytes));
    }

    let mut pg_latency_rows = Vec::new();
    if args.wants("postgres") || args.wants("latency") {
        for (i, &major) in args.pg_majors.iter().enumerate() {
            let (pg_rows, pg_latency) = postgres_section(
                &rt,
                major,
                n,
                record_bytes,
                quick,
                args.wants("postgres"),
                args.wants("latency") && i == 0,
                args.baseline.as_ref(),
            );
            rows.extend(pg_rows);
            if i == 0 {
                pg_latency_rows = pg_latency;
            }
        }
    }

    // Latency at offered rates (outboxd running and caught up, 1-row transactions).
    let mut latency_rows = Vec::new();
    // The latency and restart sections each get a fresh broker, so that what the earlier
    // sections sent does not weigh on it. outboxd's /metrics (its histograms) is scraped during
    // the latency section.
    let http_port = rig::free_port();
    let fresh_broker = |outboxd: &mut Outboxd| {
        let fresh = Broker::start();
        create_topic(&fresh.bootstrap(), TOPIC, 6);
        outboxd.rewrite_config(&config_body(
            &db.cdc_url(),
            &fresh.bootstrap(),
            "",
            &format!("127.0.0.1:{http_port}"),
        ));
        fresh
    };
    if args.wants("latency") {
        let broker = Broker::start();
        latency::create_topic(&broker.bootstrap(), TOPIC);
        let target = latency::Target {
            pg_url: None,
            db_pid: db.pid(),
            broker: &broker,
            topic: TOPIC,
            http_port,
        };
        let config = |kafka: &str| {
            config_body(
                &db.cdc_url(),
                &broker.bootstrap(),
                kafka,
                &format!("127.0.0.1:{http_port}"),
            )
        };
        let (rows, now_loaded) = latency::each_setting(
            &rt,
            &target,
            &mut outboxd,
            config,
            |o| at_gtid(&gtid_pos(&db))(o),
            quick,
            loaded,
        );
        latency_rows = rows;
        // Debezium beside it, measured the same way into the same broker (after outboxd stopped).
        latency_rows.extend(debezium::latency(&rt, &db, &broker, quick, now_loaded).0);
    }

    if args.wants("checkpoint") {
        checkpoint_scan::run(&db, quick, args.baseline.as_ref());
    }

    if args.wants("audit") {
        audit::run(&db, quick);
    }

    let restart = args.wants("restart").then(|| {
        let broker = fresh_broker(&mut outboxd);
        restart_to_first_event(&db, &broker, &mut outboxd, quick)
    });

    println!("\n| measurement | events | seconds | events/s | MB/s | notes |");
    println!("|---|---:|---:|---:|---:|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.2} | {:.0} | {:.1} | {} |",
            r.what,
            r.events,
            r.seconds,
            r.rate(),
            r.bytes as f64 / r.seconds / 1e6,
            r.extra
        );
    }
    let rate = |key: &str| rows.iter().find(|r| r.key == key).map(Row::rate);
    let ratio = |a: &str, b: &str| match (rate(a), rate(b)) {
        (Some(a), Some(b)) => format!("{:.2}", a / b),
        _ => "(not run)".into(),
    };
    println!(
        "\nratios (MariaDB, 10-row transactions): outboxd / raw source = {}, outboxd / raw broker = {}, outboxd / polling relay = {}",
        ratio("drain10", "raw-source"),
        ratio("drain10", "raw-broker"),
        ratio("drain10", "relay"),
    );
    println!(
        "ratios (MariaDB): outboxd with linger.ms = 0 / with its defaults = {} (1-row), {} (10-row), {} (100-row)",
        ratio("low-drain1", "drain1"),
        ratio("low-drain10", "drain10"),
        ratio("low-drain100", "drain100"),
    );
    for (size, drain, td, po, pu, base) in [
        (
            1,
            "pg-drain1",
            "pg-raw1",
            "pg-rawpo1",
            "pg-rawpu1",
            "pg-base1",
        ),
        (
            10,
            "pg-drain",
            "pg-raw-source",
            "pg-rawpo10",
            "pg-rawpu10",
            "pg-base10",
        ),
        (
            100,
            "pg-drain100",
            "pg-raw100",
            "pg-rawpo100",
            "pg-rawpu100",
            "pg-base100",
        ),
    ] {
        if rate(drain).is_none() {
            continue;
        }
        println!(
            "ratios (Postgres, {size}-row transactions): outboxd / pg_recvlogical test_decoding = {}, / pg_recvlogical pgoutput = {} (over a Unix socket: {}); baseline build: {} and {}",
            ratio(drain, td),
            ratio(drain, po),
            ratio(drain, pu),
            ratio(base, td),
            ratio(base, po),
        );
    }
    if rate("peer-deltaforge").is_some() {
        println!(
            "ratios (MariaDB, DeltaForge's outbox shape, 10-row transactions): outboxd / DeltaForge = {}, outboxd / raw source = {}",
            ratio("peer-outboxd", "peer-deltaforge"),
            ratio("peer-outboxd", "raw-source"),
        );
    }
    if rate("peer-pg-deltaforge").is_some() {
        println!(
            "ratios (Postgres, table-less outbox, 10-message transactions): outboxd / DeltaForge = {}",
            ratio("peer-pg-outboxd", "peer-pg-deltaforge"),
        );
    }
    if rate("rabbitmq").is_some() {
        println!(
            "ratios (MariaDB, 10-row transactions): RabbitMQ outboxd / lapin alone = {}; NATS outboxd / async-nats alone = {}; Redis outboxd / redis-rs alone = {}; Redis exactly-once / at-least-once = {}",
            ratio("rabbitmq", "rabbitmq-raw"),
            ratio("nats", "nats-raw"),
            ratio("redis", "redis-raw"),
            ratio("redis-eos", "redis"),
        );
    }
    if rate("eos").is_some() {
        println!(
            "ratios (MariaDB, 10-row transactions, Kafka checkpoint, Apache Kafka): exactly-once / at-least-once = {} (default interval), {} (1 s)",
            ratio("eos", "eos-alo"),
            ratio("eos-1s", "eos-alo"),
        );
    }
    if rate("base-drain10").is_some() || rate("pg-base10").is_some() {
        println!(
            "ratios of the baseline build (10-row transactions): MariaDB outboxd / raw source = {}, Postgres outboxd / raw source = {}",
            ratio("base-drain10", "raw-source"),
            ratio("pg-base10", "pg-raw-source"),
        );
    }
    for (source, rows) in [("MariaDB", &latency_rows), ("Postgres", &pg_latency_rows)] {
        if !rows.is_empty() {
            latency::print(source, rows);
        }
    }
    if !latency_rows.is_empty() || !pg_latency_rows.is_empty() {
        // The full run's plot is the one BENCHMARKS.md shows; a quick run's goes to target/.
        let plot = if quick {
            "target/latency-vs-rate-quick.png"
        } else {
            "benches/latency-vs-rate.png"
        };
        latency::plot(
            plot,
            &[("MariaDB", &latency_rows), ("Postgres", &pg_latency_rows)],
        );
        println!("\n(plot: {plot})");
    }
    if let Some(restart) = restart {
        println!("\n{restart}");
    }
}

/// Throughput measurements are taken this many times; the table shows the median run.
const REPEATS: usize = 3;

/// The checkpoints in the Kafka checkpoint topic as a read_committed consumer sees them, tailed on
/// a thread: pipeline name -> its position's GTID state.
struct CheckpointTail {
    seen: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, String>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl CheckpointTail {
    fn start(bootstrap: &str) -> CheckpointTail {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("group.id", "bench-checkpoint-tail")
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset("outboxd.checkpoints", 0, Offset::Beginning)
            .unwrap();
        consumer.assign(&tpl).unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (writing, stopping) = (seen.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stopping.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(Ok(m)) = consumer.poll(Duration::from_millis(50)) {
                    let key = String::from_utf8_lossy(m.key().unwrap_or_default()).to_string();
                    let gtid = m
                        .payload()
                        .and_then(|v| serde_json::from_slice::<serde_json::Value>(v).ok())
                        .and_then(|v| v["position"]["gtid_set"].as_str().map(str::to_string));
                    if let Some(gtid) = gtid {
                        writing.lock().unwrap().insert(key, gtid);
                    }
                }
            }
        });
        CheckpointTail { seen, stop }
    }

    fn gtid(&self, name: &str) -> Option<String> {
        self.seen.lock().unwrap().get(name).cloned()
    }
}

impl Drop for CheckpointTail {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Exactly-once beside at-least-once: two pipelines with the Kafka checkpoint store drain the same
/// backlog of `n` rows (10-row transactions, ids from `from`) to a fresh Apache Kafka, interleaved run
/// by run, each from the same start.
/// With `--baseline`, that build drains the same backlog at-least-once and exactly-once too,
/// interleaved with this build's runs.
fn exactly_once_section(
    db: &Mysqld,
    from: u64,
    n: u64,
    record_bytes: u64,
    baseline: Option<&(std::path::PathBuf, String)>,
) -> Vec<Row> {
    let broker = Broker::start();
    create_topic(&broker.bootstrap(), TOPIC, 6);
    let tail = CheckpointTail::start(&broker.bootstrap());
    let mut kinds: Vec<(&str, &'static str, &'static str, bool)> = vec![
        ("bench-alo", "eos-alo", "", false),
        ("bench-eos", "eos", "exactly_once = true", false),
        (
            "bench-eos-1s",
            "eos-1s",
            "exactly_once = true\ntransaction_interval_ms = 1000",
            false,
        ),
    ];
    if baseline.is_some() {
        kinds.push(("bench-alo-base", "eos-alo-base", "", true));
        kinds.push(("bench-eos-base", "eos-base", "exactly_once = true", true));
    }
    let mut pipelines: Vec<(Outboxd, &'static str, &'static str)> = kinds
        .into_iter()
        .map(|(name, key, kafka, base)| {
            let mut outboxd = Outboxd::with_checkpoint(
                name,
                &config_body(&db.cdc_url(), &broker.bootstrap(), kafka, ""),
                "store = \"kafka\"\ntakeover_timeout_ms = 3000",
            );
            if let (true, Some((path, _))) = (base, baseline) {
                outboxd.binary = path.clone();
            }
            outboxd.start();
            outboxd.stop();
            (outboxd, key, kafka)
        })
        .collect();
    wait_until("the start checkpoints", Duration::from_secs(60), || {
        pipelines
            .iter()
            .all(|(o, _, _)| tail.gtid(&o.name).is_some())
    });
    let starts: Vec<String> = pipelines
        .iter()
        .map(|(o, _, _)| tail.gtid(&o.name).unwrap())
        .collect();
    db.sql_socket(&load_script(from, from + n, 10));
    let target = gtid_pos(db);
    let mut runs: Vec<Vec<(f64, ProcessStats)>> = pipelines.iter().map(|_| Vec::new()).collect();
    for _ in 0..REPEATS {
        for (i, (outboxd, _, _)) in pipelines.iter_mut().enumerate() {
            let started = Instant::now();
            let set = outboxd
                .command(&["checkpoint", "set", &format!("gtid:{}", starts[i])])
                .output()
                .unwrap();
            assert!(
                set.status.success(),
                "checkpoint set of {} ({}) failed after {:?}: {set:?}",
                outboxd.name,
                outboxd.binary.display(),
                started.elapsed()
            );
            let name = outboxd.name.clone();
            let broker_before = process_stats(broker.pid()).cpu_seconds;
            let mut run = timed_run(outboxd, "a Kafka-checkpoint pipeline to drain", |_| {
                tail.gtid(&name).as_deref() == Some(target.as_str())
            });
            run.1.peers_cpu = format!(
                "Apache Kafka {:.1}",
                process_stats(broker.pid()).cpu_seconds - broker_before
            );
            runs[i].push(run);
        }
    }
    pipelines
        .iter()
        .zip(runs)
        .map(|((_, key, kafka), runs)| {
            let (seconds, stats, spread) = median(runs, n);
            let mode = if kafka.is_empty() {
                "at-least-once".to_string()
            } else {
                format!("exactly-once ({})", kafka.replace('\n', ", "))
            };
            let build = match baseline {
                Some((_, label)) if key.ends_with("-base") => format!("outboxd {label}"),
                _ => "outboxd".to_string(),
            };
            Row {
                key,
                what: format!(
                    "{build} {mode}, Kafka checkpoint, Apache Kafka, MariaDB backlog drain, 10-row transactions"
                ),
                events: n,
                seconds,
                bytes: n * record_bytes,
                extra: format!(
                    "{spread}; {:.1} CPU s ({} CPU s), peak RSS {:.0} MB, open {:.2} s",
                    stats.cpu_seconds, stats.peers_cpu, stats.peak_rss_mb, stats.open_seconds
                ),
            }
        })
        .collect()
}

/// The median run by time, and the range of rates over all runs (as text).
fn median<T>(mut runs: Vec<(f64, T)>, events: u64) -> (f64, T, String) {
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let fastest = events as f64 / runs[0].0;
    let slowest = events as f64 / runs[runs.len() - 1].0;
    let spread = format!(
        "median of {}, range {:.0}k–{:.0}k/s",
        runs.len(),
        slowest / 1000.0,
        fastest / 1000.0
    );
    let (seconds, stats) = runs.swap_remove(runs.len() / 2);
    (seconds, stats, spread)
}

/// The median of repeated measurements, its notes prefixed with the range.
fn median_row(rows: Vec<Row>) -> Row {
    let events = rows[0].events;
    let (_, mut row, spread) = median(rows.into_iter().map(|r| (r.seconds, r)).collect(), events);
    row.extra = format!("{spread}; {}", row.extra);
    row
}

fn gtid_pos(db: &Mysqld) -> String {
    db.sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string()
}

/// The raw source limit: the server's own tool reading the same binlog (10-row transactions).
fn raw_source(db: &Mysqld, file: &str, n: u64, record_bytes: u64) -> Row {
    let peers_before = peer_cpu();
    let cpu_before = children_cpu_seconds();
    let start = Instant::now();
    let status = Command::new("mariadb-binlog")
        .args([
            "--read-from-remote-server",
            "--host=127.0.0.1",
            "--user=root",
        ])
        .arg(format!("--port={}", db.port))
        .args(["--base64-output=decode-rows", "-v", file])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    let seconds = start.elapsed().as_secs_f64();
    assert!(status.success());
    let cpu = children_cpu_seconds() - cpu_before;
    let peers = peer_cpu_seconds_since(&peers_before);
    Row {
        key: "raw-source",
        what: "raw source: mariadb-binlog -v, same binlog (10-row transactions)".into(),
        events: n,
        seconds,
        bytes: n * record_bytes,
        extra: format!(
            "decodes every row to text, writes to /dev/null; {cpu:.1} CPU s in mariadb-binlog ({} CPU s); cores busy {:.2}",
            peer_cpu_since(&peers_before),
            (cpu + peers) / seconds
        ),
    }
}

/// The warm-up outboxd does (`KafkaSink::warm_up`): without it an idempotent producer's first record
/// waits half a second for its producer id.
fn warm_up(producer: &FutureProducer) {
    for _ in 0..2 {
        producer
            .client()
            .fetch_metadata(None, Duration::from_secs(1))
            .unwrap();
    }
}

/// The raw broker limit: librdkafka alone, same records, acks=all, idempotent.
async fn raw_broker(broker: &Broker, n: u64, record_bytes: u64) -> Row {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("queue.buffering.max.messages", "200000")
        .create()
        .unwrap();
    let peers_before = peer_cpu();
    let self_before = process_stats(std::process::id() as i32).cpu_seconds;
    let start = Instant::now();
    warm_up(&producer);
    let mut pending = Vec::with_capacity(10_000);
    for m in 0..n {
        let key = format!("key-{}", m % KEYS);
        let value = payload(m, 0);
        loop {
            let record = FutureRecord::to("raw.broker").key(&key).payload(&value);
            match producer.send_result(record) {
                Ok(f) => {
                    pending.push(f);
                    break;
                }
                Err(_) => {
                    for f in pending.drain(..) {
                        f.await.unwrap().unwrap();
                    }
                }
            }
        }
        if pending.len() >= 10_000 {
            for f in pending.drain(..) {
                f.await.unwrap().unwrap();
            }
        }
    }
    for f in pending.drain(..) {
        f.await.unwrap().unwrap();
    }
    let seconds = start.elapsed().as_secs_f64();
    Row {
        key: "raw-broker",
        what: "raw broker: librdkafka producer alone, acks=all".into(),
        events: n,
        seconds,
        bytes: n * record_bytes,
        extra: format!(
            "same record size and keys; {:.1} CPU s in the producer ({} CPU s)",
            process_stats(std::process::id() as i32).cpu_seconds - self_before,
            peer_cpu_since(&peers_before)
        ),
    }
}

async fn polling_relay(db: &Mysqld, broker: &Broker) -> (u64, u64, f64) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .unwrap();
    let mut conn = mysql_async::Conn::from_url(format!("mysql://root@127.0.0.1:{}/", db.port))
        .await
        .unwrap();
    let start = Instant::now();
    // Fair to the relay: the same producer warm-up outboxd does.
    warm_up(&producer);
    let (mut relayed, mut queries) = (0u64, 0u64);
    loop {
        let mut tx = conn.start_transaction(Default::default()).await.unwrap();
        let batch: Vec<(Vec<u8>, String, String)> = tx
            .query(
                "SELECT id, aggregateid, payload FROM app.outbox ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED",
            )
            .await
            .unwrap();
        queries += 2;
        if batch.is_empty() {
            tx.commit().await.unwrap();
            break;
        }
        let sends: Vec<_> = batch
            .iter()
            .map(|(_, key, value)| {
                producer
                    .send_result(FutureRecord::to("relay.order").key(key).payload(value))
                    .unwrap()
            })
            .collect();
        for s in sends {
            s.await.unwrap().unwrap();
        }
        let ids: Vec<String> = batch
            .iter()
            .map(|(id, _, _)| {
                format!(
                    "0x{}",
                    id.iter().map(|b| format!("{b:02x}")).collect::<String>()
                )
            })
            .collect();
        tx.query_drop(format!(
            "DELETE FROM app.outbox WHERE id IN ({})",
            ids.join(",")
        ))
        .await
        .unwrap();
        tx.commit().await.unwrap();
        queries += 2;
        relayed += batch.len() as u64;
    }
    (relayed, queries, start.elapsed().as_secs_f64())
}

/// The pids whose parent is `pid`.
fn children_of(pid: i32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit(')')
                        .next()?
                        .split_whitespace()
                        .nth(1)?
                        .parse::<i32>()
                        .ok()
                })
                == Some(pid)
        })
        .collect()
}

/// CPU seconds of a process and its direct children (a Postgres postmaster and its backends).
fn tree_cpu_seconds(pid: i32) -> f64 {
    let children: f64 = children_of(pid)
        .into_iter()
        .map(|child| process_stats(child).cpu_seconds)
        .sum();
    process_stats(pid).cpu_seconds + children
}

/// CPU seconds this process's waited-for children used so far (`cutime + cstime`).
fn children_cpu_seconds() -> f64 {
    stat_cpu_seconds("self", true)
}

/// `pg_recvlogical` reading `slot` (created with `plugin`) up to `end` into /dev/null: (seconds,
/// its CPU seconds).
fn pg_recvlogical(
    pg: &Postgres,
    slot: &str,
    plugin: &str,
    unix: bool,
    end: &str,
) -> (f64, (f64, String)) {
    let cpu_before = children_cpu_seconds();
    let start = Instant::now();
    let mut command = Command::new(format!("{}/pg_recvlogical", rig::postgres::BIN));
    command
        .args([
            "-U",
            "postgres",
            "-d",
            "app",
            "--slot",
            slot,
            "--start",
            "-f",
            "/dev/null",
        ])
        .args(["--endpos", end, "--no-loop"])
        .arg("-p")
        .arg(pg.port.to_string())
        .arg("-h");
    // TCP on loopback, as outboxd reads, unless asked for the Unix socket.
    if unix {
        command.arg(pg.dir());
    } else {
        command.arg("127.0.0.1");
    }
    if plugin == "pgoutput" {
        command.args(["-o", "proto_version=1", "-o", "publication_names=rawpub"]);
    }
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Its walsender's CPU, sampled while it runs and read once more when it ends (an exited
    // backend keeps its counters until the postmaster reaps it; the last sample counts if not).
    let postmaster = pg.postmaster_pid().expect("postmaster.pid").as_raw();
    let mut walsender: std::collections::HashMap<i32, f64> = Default::default();
    let sample = |walsender: &mut std::collections::HashMap<i32, f64>| {
        for pid in children_of(postmaster) {
            let ours = walsender.contains_key(&pid)
                || std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|cmd| cmd.contains("walsender postgres"));
            if ours {
                let cpu = process_stats(pid).cpu_seconds;
                let seen = walsender.entry(pid).or_default();
                *seen = seen.max(cpu);
            }
        }
    };
    let status = loop {
        sample(&mut walsender);
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let seconds = start.elapsed().as_secs_f64();
    sample(&mut walsender);
    assert!(status.success(), "pg_recvlogical on {slot}");
    let walsender_cpu: f64 = walsender.values().sum();
    (
        seconds,
        (
            children_cpu_seconds() - cpu_before,
            format!("its walsender {walsender_cpu:.1}"),
        ),
    )
}

/// The same drains against PostgreSQL `major` (pgoutput) with `pg_recvlogical` reading the same
/// WAL (with `drains`), and the latency series against a Postgres outbox (with `latency`). Rows of
/// a major other than 15 carry it in their key (`pg-drain1@18`) and label.
#[allow(clippy::too_many_arguments)]
fn postgres_section(
    rt: &tokio::runtime::Runtime,
    major: u32,
    n: u64,
    record_bytes: u64,
    quick: bool,
    drains: bool,
    latency: bool,
    baseline: Option<&(std::path::PathBuf, String)>,
) -> (Vec<Row>, Vec<latency::Latency>) {
    // Per size: up to 3 + 3 pipelines' slots and 9 raw readers' slots.
    let pg = Postgres::start_major(
        major,
        &["max_replication_slots = 20", "max_wal_senders = 20"],
    );
    pg.sql("postgres", "CREATE DATABASE app;");
    let postmaster = pg.postmaster_pid().expect("postmaster.pid").as_raw();
    let tag = |key: &'static str| -> &'static str {
        match major {
            15 => key,
            _ => Box::leak(format!("{key}@{major}").into_boxed_str()),
        }
    };
    let version = match major {
        15 => String::new(),
        _ => format!("PostgreSQL {major}: "),
    };
    // A broker of its own: the shared one holds every record the MariaDB sections sent, and
    // costs more CPU per record for it (1.1 against 0.6 CPU s per 200k rows in one run).
    let broker = Broker::start();
    let saved_peers = std::mem::replace(
        &mut *PEERS.lock().unwrap(),
        vec![("broker", broker.pid()), ("Postgres", postmaster)],
    );
    pg.sql(
        "app",
        "CREATE ROLE cdc WITH LOGIN REPLICATION;
         CREATE TABLE public.outbox (id uuid PRIMARY KEY, aggregatetype text, aggregateid text, type text, payload jsonb);
         ALTER TABLE public.outbox OWNER TO cdc; GRANT CREATE ON DATABASE app TO cdc;",
    );
    let topic = "outbox.event.pgbench";
    create_topic(&broker.bootstrap(), topic, 6);
    let http_port = rig::free_port();
    let body = format!(
        "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\nheartbeat_interval_ms = 1000\n\
         [kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"127.0.0.1:{http_port}\"\n",
        pg.url("cdc", "app"),
        broker.bootstrap()
    );
    let old_bootstrap = broker.bootstrap();
    let mut outboxd = Outboxd::new("pgbench", &body);
    outboxd.start();
    outboxd.stop();
    let probe = topic_probe(&broker);
    let acked = || topic_end(&probe, topic);
    let mut rows = Vec::new();
    let mut loaded = 0;
    pg.sql("app", "CREATE PUBLICATION rawpub FOR TABLE public.outbox;");
    let sizes: &[(u64, &str)] = if drains {
        &[(1u64, "pg-drain1"), (10, "pg-drain"), (100, "pg-drain100")]
    } else {
        &[]
    };
    for &(per_txn, key) in sizes {
        // pg_recvlogical reads exactly this load's WAL, once per repeat (a slot of its own each
        // time), with test_decoding (text) and with pgoutput (what outboxd reads).
        // The third reads pgoutput over a Unix socket, as a client on the database's host could
        // (outboxd reads over TCP, like the other two).
        let raw_slots: Vec<(String, String, bool)> = (0..REPEATS)
            .flat_map(|rep| {
                [
                    ("td", "test_decoding", false),
                    ("po", "pgoutput", false),
                    ("pu", "pgoutput", true),
                ]
                .map(|(tag, plugin, unix)| {
                    (format!("raw{tag}{per_txn}r{rep}"), plugin.to_string(), unix)
                })
            })
            .collect();
        for (slot, plugin, _) in &raw_slots {
            pg.sql(
                "app",
                &format!("SELECT pg_create_logical_replication_slot('{slot}', '{plugin}');"),
            );
        }
        // A slot only moves forward, so each repeat drains the load with a pipeline of its own (own
        // slot, publication and checkpoint) created just before it: the same WAL every time. The
        // long-lived pipeline is this build's first repeat (it stays caught up for the latency
        // section); with a baseline, as many baseline pipelines drain it too.
        let fresh = |label: &str, rep: usize, binary: Option<&std::path::PathBuf>| {
            let name = format!("pg{label}{per_txn}r{rep}");
            let own_body = body.replace(
                "heartbeat_interval_ms = 1000\n",
                &format!(
                    "heartbeat_interval_ms = 1000\nslot = \"{name}\"\npublication = \"{name}\"\n"
                ),
            );
            let mut pipeline = Outboxd::new(&name, &own_body);
            if let Some(binary) = binary {
                pipeline.binary = binary.clone();
            }
            pipeline.start();
            pipeline.stop();
            (name, pipeline)
        };
        let mut extra: Vec<(String, Outboxd)> =
            (1..REPEATS).map(|rep| fresh("new", rep, None)).collect();
        let mut base_pipelines: Vec<(String, Outboxd)> = baseline
            .map(|(path, _)| {
                (0..REPEATS)
                    .map(|rep| fresh("base", rep, Some(path)))
                    .collect()
            })
            .unwrap_or_default();
        pg.sql(
            "app",
            &pg_load_script(loaded, loaded + n, per_txn, "pgbench"),
        );
        loaded += n;
        let raw_end = pg
            .sql("app", "SELECT pg_current_wal_lsn();")
            .trim()
            .to_string();
        // Interleaved: baseline, this build, the raw readers, baseline, ...
        let mut runs: Vec<(f64, ProcessStats)> = Vec::new();
        let mut base_runs: Vec<(f64, ProcessStats)> = Vec::new();
        let mut raw_runs: [Vec<(f64, (f64, String))>; 3] = Default::default();
        for rep in 0..REPEATS {
            if let Some((_, pipeline)) = base_pipelines.get_mut(rep) {
                let target = acked() + n;
                base_runs.push(timed_run(
                    pipeline,
                    "the baseline to drain the Postgres backlog",
                    |_| acked() >= target,
                ));
            }
            let pipeline = match rep {
                0 => &mut outboxd,
                _ => &mut extra[rep - 1].1,
            };
            let target = acked() + n;
            runs.push(timed_run(
                pipeline,
                "outboxd to drain the Postgres backlog",
                |_| acked() >= target,
            ));
            for (i, (slot, plugin, unix)) in raw_slots[rep * 3..rep * 3 + 3].iter().enumerate() {
                raw_runs[i].push(pg_recvlogical(&pg, slot, plugin, *unix, &raw_end));
            }
        }
        for (slot, _, _) in &raw_slots {
            pg.sql(
                "app",
                &format!("SELECT pg_drop_replication_slot('{slot}');"),
            );
        }
        for (i, runs) in raw_runs.into_iter().enumerate() {
            let (seconds, (cpu, peers), spread) = median(runs, n);
            let (plugin, note) = match i {
                0 => ("test_decoding", "decodes every row to text"),
                1 => ("pgoutput", "the stream outboxd reads"),
                _ => (
                    "pgoutput over a Unix socket",
                    "the same stream, cheaper to send and read",
                ),
            };
            rows.push(Row {
                key: tag(match (i, per_txn) {
                    (0, 1) => "pg-raw1",
                    (0, 10) => "pg-raw-source",
                    (0, _) => "pg-raw100",
                    (1, 1) => "pg-rawpo1",
                    (1, 10) => "pg-rawpo10",
                    (1, _) => "pg-rawpo100",
                    (_, 1) => "pg-rawpu1",
                    (_, 10) => "pg-rawpu10",
                    (_, _) => "pg-rawpu100",
                }),
                what: format!(
                    "{version}raw source: pg_recvlogical ({plugin}), same WAL ({per_txn}-row transactions)"
                ),
                events: n,
                seconds,
                bytes: n * record_bytes,
                extra: format!(
                    "{spread}; {cpu:.1} CPU s in pg_recvlogical ({peers} CPU s); {note}, writes to /dev/null"
                ),
            });
        }
        for (name, _) in extra.iter().chain(base_pipelines.iter()) {
            pg.sql(
                "app",
                &format!("SELECT pg_drop_replication_slot('{name}');"),
            );
        }
        for (label, runs) in [(None, runs), (baseline.map(|(_, l)| l.as_str()), base_runs)] {
            if runs.is_empty() {
                continue;
            }
            let (seconds, stats, spread) = median(runs, n);
            let who = build_label(label);
            rows.push(Row {
                key: tag(match (label.is_some(), per_txn) {
                    (false, _) => key,
                    (true, 1) => "pg-base1",
                    (true, 10) => "pg-base10",
                    (true, _) => "pg-base100",
                }),
                what: format!("{version}{who}, Postgres backlog drain, {per_txn}-row transactions"),
                events: n,
                seconds,
                bytes: n * record_bytes,
                extra: format!(
                    "{spread}; {:.1} CPU s ({} CPU s), {:.1} context switches per 100 rows, peak RSS {:.0} MB (acked = topic high watermarks), {}",
                    stats.cpu_seconds, stats.peers_cpu, stats.switches as f64 * 100.0 / n as f64, stats.peak_rss_mb,
                    where_the_time_went(&stats, n, seconds)
                ),
            });
        }
    }

    *PEERS.lock().unwrap() = saved_peers;
    let mut latencies = Vec::new();
    if latency {
        // A fresh broker, as for MariaDB's series.
        let broker = Broker::start();
        latency::create_topic(&broker.bootstrap(), topic);
        let url = pg.url("postgres", "app");
        let target = latency::Target {
            pg_url: Some(&url),
            db_pid: postmaster,
            broker: &broker,
            topic,
            http_port,
        };
        // The kafka lines go right after `brokers`, inside `[kafka]`.
        let config = |kafka: &str| {
            body.replace(
                &format!("brokers = \"{old_bootstrap}\"\n"),
                &format!("brokers = \"{}\"\n{kafka}", broker.bootstrap()),
            )
        };
        // outboxd stopped caught up after the drains; `/readyz` says when it streams again.
        let (rows, next) =
            latency::each_setting(rt, &target, &mut outboxd, config, |_| true, quick, loaded);
        latencies = rows;
        // Debezium beside it, measured the same way into the same broker (after outboxd stopped).
        latencies.extend(debezium::pg_latency(rt, &pg, &url, &broker, quick, next).0);
    }
    (rows, latencies)
}

/// Restart behind a large backlog: outboxd is stopped, about 1 GiB of binlog (100 MiB with `--quick`)
/// of outbox rows is written behind its checkpoint, then it starts again. Reports the time from the
/// process start to the first record a consumer receives, and to the checkpoint reaching the end.
fn restart_to_first_event(
    db: &Mysqld,
    broker: &Broker,
    outboxd: &mut Outboxd,
    quick: bool,
) -> String {
    const TOPIC: &str = "outbox.event.restart";
    const CHUNK: u64 = 5_000;
    let target_bytes: u64 = if quick { 100 << 20 } else { 1 << 30 };
    create_topic(&broker.bootstrap(), TOPIC, 6);
    // The checkpoint is at the end of the binlog now (everything before was drained and acked).
    let caught_up = gtid_pos(db);
    outboxd.start();
    wait_until("outboxd to catch up", Duration::from_secs(600), || {
        at_gtid(&caught_up)(outboxd)
    });
    outboxd.stop();
    db.sql_socket("FLUSH BINARY LOGS;");
    let first_file = db
        .sql_socket("SHOW MASTER STATUS;")
        .split('\t')
        .next()
        .unwrap()
        .to_string();
    let backlog_bytes = || -> u64 {
        db.sql_socket("SHOW BINARY LOGS;")
            .lines()
            .filter_map(|l| {
                let mut f = l.split('\t');
                Some((f.next()?.to_string(), f.next()?.trim().parse::<u64>().ok()?))
            })
            .filter(|(name, _)| name.as_str() >= first_file.as_str())
            .map(|(_, size)| size)
            .sum()
    };
    let mut rows = 0u64;
    let load_start = Instant::now();
    while backlog_bytes() < target_bytes {
        db.sql_socket(&format!(
            "INSERT INTO app.outbox (id,aggregatetype,aggregateid,type,payload) \
             SELECT UNHEX(LPAD(HEX(seq + {base}), 32, '0')), 'restart', CONCAT('key-', seq % {KEYS}), 'Created', REPEAT('r', 1000) \
             FROM app.seq_1_to_{CHUNK};",
            base = 500_000_000 + rows
        ));
        rows += CHUNK;
    }
    let bytes = backlog_bytes();
    eprintln!(
        "restart backlog: {rows} rows, {:.0} MiB of binlog, loaded in {:.0} s",
        bytes as f64 / (1u64 << 20) as f64,
        load_start.elapsed().as_secs_f64()
    );
    let end = gtid_pos(db);

    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("group.id", "bench-restart")
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "5")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..6 {
        tpl.add_partition_offset(TOPIC, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    // A sentinel record proves the consumer is fetching before the clock starts (its own start-up
    // would otherwise be counted); outboxd's first record is the next one it sees.
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .create()
        .unwrap();
    producer
        .send(BaseRecord::to(TOPIC).key("sentinel").payload("sentinel"))
        .map_err(|(e, _)| e)
        .unwrap();
    producer.flush(Duration::from_secs(10)).unwrap();
    wait_until(
        "the consumer to see the sentinel",
        Duration::from_secs(60),
        || matches!(consumer.poll(Duration::from_millis(50)), Some(Ok(m)) if m.key() == Some(b"sentinel")),
    );
    let started = Instant::now();
    let first = std::thread::spawn(move || loop {
        if let Some(Ok(_)) = consumer.poll(Duration::from_millis(5)) {
            return started.elapsed().as_secs_f64();
        }
        if started.elapsed() > Duration::from_secs(600) {
            return f64::NAN;
        }
    });
    let (seconds, stats) = timed_run(
        outboxd,
        "outboxd to drain the restart backlog",
        at_gtid(&end),
    );
    let first = first.join().unwrap();
    format!(
        "Restart behind a backlog: {rows} rows ({:.0} MiB of binlog) behind the checkpoint. \
         Process start → first record at a consumer: {first:.2} s; → checkpoint at the end: {seconds:.1} s \
         ({:.0} events/s, {:.0} MB/s of binlog, {:.1} CPU s, peak RSS {:.0} MB).",
        bytes as f64 / (1u64 << 20) as f64,
        rows as f64 / seconds,
        bytes as f64 / seconds / 1e6,
        stats.cpu_seconds,
        stats.peak_rss_mb
    )
}

/// The backlog the peer comparison drains: DeltaForge's outbox column names, every column a
/// VARCHAR (DeltaForge wraps TEXT/BLOB values, MariaDB's JSON among them, in base64).
const PEER_TABLE: &str = "CREATE TABLE app.df_outbox (
  id VARCHAR(36) NOT NULL PRIMARY KEY,
  aggregate_type VARCHAR(255) NOT NULL,
  aggregate_id VARCHAR(255) NOT NULL,
  event_type VARCHAR(255) NOT NULL,
  payload VARCHAR(2048)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;";

/// A DeltaForge process (`--peer deltaforge=PATH`): its pipeline file, storage and ports.
struct DeltaForge {
    binary: std::path::PathBuf,
    dir: std::path::PathBuf,
    /// Its REST API, which also serves `/metrics` (95b4d93 accepts `--metrics-addr` but ignores it:
    /// its Prometheus listener is fixed at `0.0.0.0:9000`).
    api_port: u16,
    child: Option<std::process::Child>,
}

impl DeltaForge {
    /// A pipeline named `peer` reading `source` (the YAML under `spec.source`) with DeltaForge's
    /// outbox processor into `outbox.event.<aggregate_type>`, with the settings of its own backlog-drain benchmark
    /// (`crates/chaos/src/scenarios/backlog_drain.rs`: batches of up to 4000 events or 100 ms,
    /// 4 in flight, checkpoints only after the sink's acks, schema sensing off, `linger.ms` 0);
    /// its Kafka sink is idempotent with acks=all by itself.
    fn new(binary: &std::path::Path, source: &str, bootstrap: &str) -> DeltaForge {
        let dir =
            std::env::temp_dir().join(format!("outboxd-bench-deltaforge-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("storage")).unwrap();
        std::fs::write(
            dir.join("pipeline.yaml"),
            format!(
                r#"apiVersion: deltaforge/v1
kind: Pipeline
metadata:
  name: peer
  tenant: bench
spec:
  source:
{source}
  processors:
    - type: outbox
      topic: "outbox.event.${{aggregate_type}}"
      default_topic: "outbox.event.unrouted"
      raw_payload: true
  sinks:
    - type: kafka
      config:
        id: kafka
        brokers: "{bootstrap}"
        topic: "outbox.event.unrouted"
        required: true
        client_conf:
          linger.ms: "0"
  batch:
    max_events: 4000
    max_ms: 100
    max_inflight: 4
  commit_policy:
    mode: required
  schema_sensing:
    enabled: false
"#
            ),
        )
        .unwrap();
        DeltaForge {
            binary: binary.to_path_buf(),
            dir,
            api_port: rig::free_port(),
            child: None,
        }
    }

    /// Starts it and waits until its Kafka sink delivered `n` events and `arrived` (the records
    /// are in the topic outboxd writes to, as the broker says): (seconds, its stats).
    fn timed_drain(&mut self, n: u64, mut arrived: impl FnMut() -> bool) -> (f64, ProcessStats) {
        let peers_before = peer_cpu();
        let start = Instant::now();
        self.start();
        let pid = self.pid();
        let mut stats = process_stats(pid);
        wait_until(
            "DeltaForge to drain the backlog",
            Duration::from_secs(1800),
            || {
                stats = process_stats(pid);
                self.delivered() >= n && arrived()
            },
        );
        let seconds = start.elapsed().as_secs_f64();
        stats.peers_cpu = peer_cpu_since(&peers_before);
        self.stop();
        (seconds, stats)
    }

    fn start(&mut self) {
        let log = std::fs::File::create(self.dir.join("deltaforge.log")).unwrap();
        let child = Command::new(&self.binary)
            .arg("--config")
            .arg(self.dir.join("pipeline.yaml"))
            .args(["--api-addr", &format!("127.0.0.1:{}", self.api_port)])
            .arg("--storage-path")
            .arg(self.dir.join("storage/deltaforge.db"))
            .env("RUST_LOG", "warn")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("the DeltaForge binary runs (--peer deltaforge=PATH)");
        self.child = Some(child);
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Events its Kafka sink delivered since it started (`deltaforge_sink_events_total`).
    fn delivered(&mut self) -> u64 {
        if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
            let log = std::fs::read_to_string(self.dir.join("deltaforge.log")).unwrap_or_default();
            panic!("DeltaForge exited early with {status}:\n{log}");
        }
        let (_, body) = rig::http_get(self.api_port, "/metrics");
        body.lines()
            .filter(|l| l.starts_with("deltaforge_sink_events_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    /// Whether its pipeline holds a checkpoint (asked of its REST API).
    fn has_checkpoint(&self) -> bool {
        let (status, body) = rig::http_get(self.api_port, "/pipelines/peer/checkpoints");
        status == 200 && body.trim() != "[]"
    }

    /// SIGTERM, then waits for the exit (SIGKILL after 30 s: a stop that hangs must not keep
    /// the servers running).
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = Instant::now() + Duration::from_secs(30);
            while child.try_wait().ok().flatten().is_none() {
                if Instant::now() > deadline {
                    eprintln!("DeltaForge did not stop within 30 s of SIGTERM; killing it");
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    fn save_storage(&self) {
        copy_dir(&self.dir.join("storage"), &self.dir.join("saved"));
    }

    fn restore_storage(&self) {
        let _ = std::fs::remove_dir_all(self.dir.join("storage"));
        copy_dir(&self.dir.join("saved"), &self.dir.join("storage"));
    }
}

impl Drop for DeltaForge {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// The nearest peer, DeltaForge, and outboxd draining the same MariaDB backlog (`n` rows in
/// 10-row transactions of `app.df_outbox`) to the same fresh broker, interleaved run by run, each
/// from a checkpoint taken before the load. DeltaForge's first run starts at the binlog's end, so
/// it is started once before the load to write a checkpoint.
fn peer_section(db: &Mysqld, binary: &std::path::Path, n: u64, record_bytes: u64) -> Vec<Row> {
    let broker = Broker::start();
    create_topic(&broker.bootstrap(), TOPIC, 6);
    let saved_peers = std::mem::replace(
        &mut *PEERS.lock().unwrap(),
        vec![("MariaDB", db.pid()), ("broker", broker.pid())],
    );
    db.sql_socket(PEER_TABLE);
    let insert = |from: u64, to: u64| {
        transactions(from, to, 10, |k| {
            format!(
                "INSERT INTO app.df_outbox (id,aggregate_type,aggregate_id,event_type,payload) VALUES ('{}','order','key-{}','Created','{}');",
                uuid_of(k),
                k % KEYS,
                payload(k, 0)
            )
        })
    };
    // A first run without a checkpoint hangs on MariaDB before it reads the binlog (95b4d93:
    // `resolve_binlog_tail` awaits `pool.disconnect()` while it still holds a pooled connection,
    // on the `SHOW MASTER STATUS` fallback), so the pipeline starts with an initial snapshot,
    // which records its binlog position with code of its own.
    let source = format!(
        r#"    type: mysql
    config:
      id: peer-mysql
      dsn: "mysql://cdc:{}@127.0.0.1:{}/app"
      tables: ["app.df_outbox"]
      outbox:
        tables: ["app.df_outbox"]
      snapshot:
        mode: initial"#,
        rig::mysqld::CDC_PASSWORD,
        db.port
    );
    let mut peer = DeltaForge::new(binary, &source, &broker.bootstrap());
    let probe = topic_probe(&broker);
    peer.start();
    // A row delivered and checkpointed fixes where its restarts resume. Rows the snapshot reads
    // write no checkpoint: one more row each second until a binlog row has.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut warm_up = 10 * n;
    while !peer.has_checkpoint() {
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(peer.dir.join("deltaforge.log")).unwrap_or_default();
            panic!("DeltaForge wrote no checkpoint within 120 s; its log:\n{log}");
        }
        peer.delivered(); // panics with its log if it exited
        db.sql_socket(&insert(warm_up, warm_up + 1));
        warm_up += 1;
        let wrote = Instant::now();
        while !peer.has_checkpoint() && wrote.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    peer.stop();
    peer.save_storage();
    let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", "")
        .replace("app.outbox", "app.df_outbox")
        + "[route]\nby = \"aggregate_type\"\nkey = \"aggregate_id\"\nid = \"id\"\n";
    let mut outboxd = Outboxd::new("peerbench", &body);
    let checkpoint = first_checkpoint(&mut outboxd);
    db.sql_socket(&insert(0, n));
    let target = gtid_pos(db);
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for _ in 0..REPEATS {
        std::fs::write(outboxd.checkpoint_path(), &checkpoint).unwrap();
        ours.push(timed_run(
            &mut outboxd,
            "outboxd to drain the peer backlog",
            at_gtid(&target),
        ));
        peer.restore_storage();
        let target = topic_end(&probe, TOPIC) + n;
        theirs.push(peer.timed_drain(n, || topic_end(&probe, TOPIC) >= target));
    }
    *PEERS.lock().unwrap() = saved_peers;
    peer_rows(
        [
            ("peer-outboxd", "outboxd, MariaDB backlog drain of DeltaForge's outbox shape (all VARCHAR), 10-row transactions", ours),
            ("peer-deltaforge", "DeltaForge 95b4d93 (peer), the same backlog, broker and start", theirs),
        ],
        n,
        record_bytes,
    )
}

/// The peer on Postgres. DeltaForge's Postgres outbox reads only `pg_logical_emit_message`
/// messages (table inserts pass as plain change events), so both drain one table-less outbox: `n`
/// messages with the prefix `outbox`, ten per transaction, each a JSON object with DeltaForge's
/// outbox fields (outboxd reads them with `source.message_prefixes`). A slot only moves forward, so
/// every run has a slot of its own made before the load (and outboxd a pipeline of its own), and
/// both start at their slot; interleaved run by run, on a fresh broker.
fn peer_postgres_section(binary: &std::path::Path, n: u64, record_bytes: u64) -> Vec<Row> {
    let pg = Postgres::start(&["max_replication_slots = 20", "max_wal_senders = 20"]);
    pg.sql("postgres", "CREATE DATABASE app;");
    let postmaster = pg.postmaster_pid().expect("postmaster.pid").as_raw();
    let broker = Broker::start();
    create_topic(&broker.bootstrap(), TOPIC, 6);
    let saved_peers = std::mem::replace(
        &mut *PEERS.lock().unwrap(),
        vec![("Postgres", postmaster), ("broker", broker.pid())],
    );
    // outboxd's publication needs a table (with the routed columns: its checks look); the
    // messages need none (DeltaForge's publication is empty).
    pg.sql(
        "app",
        "CREATE ROLE cdc WITH LOGIN REPLICATION;
         CREATE TABLE public.outbox (id uuid PRIMARY KEY, aggregate_type text, aggregate_id text, event_type text, payload jsonb);
         ALTER TABLE public.outbox OWNER TO cdc; GRANT CREATE ON DATABASE app TO cdc;
         CREATE PUBLICATION df_pub;",
    );
    let pipelines: Vec<Outboxd> = (0..REPEATS)
        .map(|rep| {
            let name = format!("pgpeer{rep}");
            let body = format!(
                "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\n\
                 slot = \"{name}\"\npublication = \"{name}\"\nmessage_prefixes = [\"outbox\"]\n\
                 heartbeat_interval_ms = 1000\n[kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"\"\n\
                 [route]\nby = \"aggregate_type\"\nkey = \"aggregate_id\"\nid = \"id\"\n",
                pg.url("cdc", "app"),
                broker.bootstrap()
            );
            let mut pipeline = Outboxd::new(&name, &body);
            pipeline.start();
            pipeline.stop();
            pipeline
        })
        .collect();
    let slots: Vec<String> = (0..REPEATS).map(|rep| format!("dfpeer{rep}")).collect();
    for slot in &slots {
        pg.sql(
            "app",
            &format!("SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput');"),
        );
    }
    let mut script = String::new();
    for first in (0..n).step_by(10) {
        let messages: Vec<String> = (first..(first + 10).min(n))
            .map(|k| {
                format!(
                    "('{{\"id\":\"{}\",\"aggregate_type\":\"order\",\"aggregate_id\":\"key-{}\",\"event_type\":\"Created\",\"payload\":{}}}')",
                    uuid_of(k),
                    k % KEYS,
                    payload(k, 0)
                )
            })
            .collect();
        script.push_str(&format!(
            "SELECT count(pg_logical_emit_message(true, 'outbox', m)) FROM (VALUES {}) AS t(m);\n",
            messages.join(",")
        ));
    }
    pg.sql("app", &script);
    let probe = topic_probe(&broker);
    let acked = || topic_end(&probe, TOPIC);
    let dsn = pg.url("cdc", "app").replace("cdc@", "cdc:cdc@");
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for (mut pipeline, slot) in pipelines.into_iter().zip(&slots) {
        let target = acked() + n;
        ours.push(timed_run(
            &mut pipeline,
            "outboxd to drain the table-less Postgres backlog",
            |_| acked() >= target,
        ));
        let source = format!(
            r#"    type: postgres
    config:
      id: peer-pg
      dsn: "{dsn}"
      slot: {slot}
      publication: df_pub
      tables: []
      outbox:
        prefixes: ["outbox"]"#
        );
        let mut peer = DeltaForge::new(binary, &source, &broker.bootstrap());
        let target = acked() + n;
        theirs.push(peer.timed_drain(n, || acked() >= target));
    }
    *PEERS.lock().unwrap() = saved_peers;
    peer_rows(
        [
            ("peer-pg-outboxd", "outboxd, Postgres table-less outbox (pg_logical_emit_message) drain, 10-message transactions", ours),
            ("peer-pg-deltaforge", "DeltaForge 95b4d93 (peer), the same messages, broker and start", theirs),
        ],
        n,
        record_bytes,
    )
}

/// A consumer that asks `broker` for watermarks.
fn topic_probe(broker: &Broker) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .create()
        .unwrap()
}

/// Records in `topic` (6 partitions): the sum of its high watermarks. Panics when the broker does
/// not answer (a guess of 0 could end a drain early).
fn topic_end(probe: &BaseConsumer, topic: &str) -> u64 {
    (0..6)
        .map(|p| {
            probe
                .fetch_watermarks(topic, p, Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("the watermarks of {topic}/{p}: {e}"))
                .1 as u64
        })
        .sum()
}

/// One tool's timed runs in a peer comparison: (row key, what, runs).
type PeerRuns<'a> = (&'static str, &'a str, Vec<(f64, ProcessStats)>);

/// The peer table's rows, for outboxd and DeltaForge.
fn peer_rows(runs: [PeerRuns<'_>; 2], n: u64, record_bytes: u64) -> Vec<Row> {
    let mut rows = Vec::new();
    for (key, what, runs) in runs {
        let (seconds, stats, spread) = median(runs, n);
        rows.push(Row {
            key,
            what: what.into(),
            events: n,
            seconds,
            bytes: n * record_bytes,
            extra: format!(
                "{spread}; {:.1} CPU s ({} CPU s), peak RSS {:.0} MB",
                stats.cpu_seconds, stats.peers_cpu, stats.peak_rss_mb
            ),
        });
    }
    rows
}

/// The RabbitMQ sink: outboxd drains a backlog of `n` rows (10-row transactions, ids from `from`)
/// into a private RabbitMQ (one durable queue bound to the routed key), beside lapin alone
/// publishing `n` messages of the same size with outboxd's settings; interleaved run by run, the
/// queue purged before each.
fn rabbitmq_section(
    db: &Mysqld,
    rt: &tokio::runtime::Runtime,
    from: u64,
    n: u64,
    record_bytes: u64,
) -> Vec<Row> {
    use rig::rabbitmq::{config_with_rabbitmq, RabbitMq};
    let rabbit = RabbitMq::start();
    rabbit.declare("outbox", &[("orders", "outbox.event.#")]);
    let mut outboxd = Outboxd::new(
        "bench-rabbit",
        &config_with_rabbitmq(
            &db.cdc_url(),
            &rabbit.url(),
            // Extra `[rabbitmq]` keys for an experiment (e.g. "max_in_flight = 2000").
            &std::env::var("OUTBOXD_BENCH_RABBITMQ").unwrap_or_default(),
        ),
    );
    let checkpoint = first_checkpoint(&mut outboxd);
    db.sql_socket(&load_script(from, from + n, 10));
    let target = gtid_pos(db);
    let body = payload(0, 0);
    let mut drains = Vec::new();
    let mut raws = Vec::new();
    for _ in 0..REPEATS {
        rabbit.purge("orders");
        std::fs::write(outboxd.checkpoint_path(), &checkpoint).unwrap();
        drains.push(timed_run(
            &mut outboxd,
            "outboxd to drain into RabbitMQ",
            at_gtid(&target),
        ));
        rabbit.purge("orders");
        let start = Instant::now();
        rt.block_on(lapin_alone(&rabbit.url(), n, body.as_bytes()));
        raws.push((start.elapsed().as_secs_f64(), ()));
    }
    let (seconds, stats, spread) = median(drains, n);
    let (raw_seconds, (), raw_spread) = median(raws, n);
    vec![
        Row {
            key: "rabbitmq",
            what: "outboxd → RabbitMQ 3.10, MariaDB backlog drain, 10-row transactions (persistent, mandatory, confirms)".into(),
            events: n,
            seconds,
            bytes: n * record_bytes,
            extra: format!(
                "{spread}; {:.1} CPU s, peak RSS {:.0} MB, open {:.2} s",
                stats.cpu_seconds, stats.peak_rss_mb, stats.open_seconds
            ),
        },
        Row {
            key: "rabbitmq-raw",
            what: "raw broker: lapin alone, same messages and settings, 10,000 in flight".into(),
            events: n,
            seconds: raw_seconds,
            bytes: n * record_bytes,
            extra: raw_spread,
        },
    ]
}

/// Publishes `n` messages of `body` as outboxd does (persistent, mandatory, confirms, a header
/// with the id and the key, at most 10,000 unconfirmed) and waits for every confirm.
async fn lapin_alone(url: &str, n: u64, body: &[u8]) {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    use lapin::types::{AMQPValue, FieldTable, LongString};
    use lapin::{BasicProperties, Connection, ConnectionProperties};
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let window = std::sync::Arc::new(tokio::sync::Semaphore::new(10_000));
    let mut confirms = tokio::task::JoinSet::new();
    for i in 0..n {
        let permit = window.clone().acquire_owned().await.unwrap();
        let mut headers = FieldTable::default();
        headers.insert(
            "id".into(),
            AMQPValue::LongString(LongString::from(uuid_of(i))),
        );
        headers.insert(
            "outboxd.key".into(),
            AMQPValue::LongString(LongString::from(format!("key-{}", i % KEYS))),
        );
        let confirm = channel
            .basic_publish(
                "outbox".into(),
                TOPIC.into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                body,
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(uuid_of(i).into())
                    .with_headers(headers),
            )
            .await
            .unwrap();
        confirms.spawn(async move {
            let confirmed = confirm.await.unwrap();
            assert!(confirmed.is_ack() && confirmed.take_message().is_none());
            drop(permit);
        });
    }
    while let Some(done) = confirms.join_next().await {
        done.unwrap();
    }
    connection.close(200, "done".into()).await.unwrap();
}

/// The NATS sink: outboxd drains a backlog of `n` rows (10-row transactions, ids from `from`) into
/// a private nats-server (one file-backed stream capturing the routed subject), beside async-nats
/// alone publishing `n` messages of the same size with outboxd's settings (`Nats-Msg-Id`, every
/// `PubAck` awaited, 10,000 in flight); interleaved run by run, the stream purged before each.
fn nats_section(
    db: &Mysqld,
    rt: &tokio::runtime::Runtime,
    from: u64,
    n: u64,
    record_bytes: u64,
) -> Vec<Row> {
    use rig::nats::{config_with_nats, Nats};
    let nats = Nats::start();
    nats.add_stream("EVENTS", &["outbox.event.>"]);
    let mut outboxd = Outboxd::new(
        "bench-nats",
        &config_with_nats(&db.cdc_url(), &nats.url(), ""),
    );
    let checkpoint = first_checkpoint(&mut outboxd);
    db.sql_socket(&load_script(from, from + n, 10));
    let target = gtid_pos(db);
    let body = payload(0, 0);
    let purge = || {
        rt.block_on(async {
            let client = async_nats::connect(nats.url()).await.unwrap();
            let js = async_nats::jetstream::new(client);
            js.get_stream("EVENTS")
                .await
                .unwrap()
                .purge()
                .await
                .unwrap();
        })
    };
    let mut drains = Vec::new();
    let mut raws = Vec::new();
    for run in 0..REPEATS {
        purge();
        std::fs::write(outboxd.checkpoint_path(), &checkpoint).unwrap();
        drains.push(timed_run(
            &mut outboxd,
            "outboxd to drain into NATS",
            at_gtid(&target),
        ));
        purge();
        let start = Instant::now();
        // Ids of their own per run: the stream's duplicate window would drop a repeat.
        rt.block_on(nats_alone(&nats.url(), n, body.as_bytes(), run));
        raws.push((start.elapsed().as_secs_f64(), ()));
    }
    let (seconds, stats, spread) = median(drains, n);
    let (raw_seconds, (), raw_spread) = median(raws, n);
    vec![
        Row {
            key: "nats",
            what: "outboxd → NATS JetStream 2.9 (file stream), MariaDB backlog drain, 10-row transactions (Nats-Msg-Id, every PubAck awaited)".into(),
            events: n,
            seconds,
            bytes: n * record_bytes,
            extra: format!(
                "{spread}; {:.1} CPU s, peak RSS {:.0} MB, open {:.2} s",
                stats.cpu_seconds, stats.peak_rss_mb, stats.open_seconds
            ),
        },
        Row {
            key: "nats-raw",
            what: "raw broker: async-nats alone, same payload and headers, PubAcks awaited in order, 10,000 in flight".into(),
            events: n,
            seconds: raw_seconds,
            bytes: n * record_bytes,
            extra: raw_spread,
        },
    ]
}

/// Publishes `n` messages of `body` as outboxd does (`Nats-Msg-Id` and the same five headers, at most
/// 10,000 without their `PubAck`) and awaits every `PubAck` in order.
async fn nats_alone(url: &str, n: u64, body: &[u8], run: usize) {
    use async_nats::jetstream::message::PublishMessage;
    let client = async_nats::connect(url).await.unwrap();
    let js = async_nats::jetstream::context::ContextBuilder::new()
        .timeout(Duration::from_secs(30))
        .max_ack_inflight(10_001)
        .build(client);
    let body = bytes::Bytes::copy_from_slice(body);
    let (acks, mut settled) = tokio::sync::mpsc::channel(10_000);
    let settler = tokio::spawn(async move {
        while let Some(ack) = settled.recv().await {
            let ack: async_nats::jetstream::context::PublishAckFuture = ack;
            let ack = ack.await.unwrap();
            assert!(!ack.duplicate);
        }
    });
    for i in 0..n {
        let mut headers = async_nats::HeaderMap::new();
        let id = format!("{run}-{}", uuid_of(i));
        headers.insert("id", id.as_str());
        headers.insert("Nats-Msg-Id", id.as_str());
        headers.insert("outboxd.key", format!("key-{}", i % KEYS).as_str());
        headers.insert("outboxd.position", format!("gtid:0-1-{i}").as_str());
        headers.insert("outboxd.timestamp", "1764183600000");
        let ack = js
            .send_publish(
                TOPIC,
                PublishMessage::build()
                    .headers(headers)
                    .payload(body.clone()),
            )
            .await
            .unwrap();
        acks.send(ack).await.unwrap();
    }
    drop(acks);
    settler.await.unwrap();
}

/// The Redis sink: outboxd drains a backlog of `n` rows into a private redis-server (append-only,
/// `appendfsync always`), beside redis-rs alone adding `n` entries of the same fields in the same
/// batches (`MULTI`/`EXEC` of 1,000, one at a time); interleaved run by run, the stream deleted
/// before each.
fn redis_section(
    db: &Mysqld,
    rt: &tokio::runtime::Runtime,
    from: u64,
    n: u64,
    record_bytes: u64,
) -> Vec<Row> {
    use rig::redis::{config_with_redis, Redis};
    let redis = Redis::start();
    let mut outboxd = Outboxd::new(
        "bench-redis",
        &config_with_redis(
            &db.cdc_url(),
            &redis.url(),
            // Extra `[redis]` keys for an experiment (e.g. "max_in_flight = 2000").
            &std::env::var("OUTBOXD_BENCH_REDIS").unwrap_or_default(),
        ),
    );
    let checkpoint = first_checkpoint(&mut outboxd);
    // The same backlog exactly once: the checkpoint in Redis, committed with the entries.
    let mut eos = Outboxd::with_checkpoint(
        "bench-redis-eos",
        &config_with_redis(
            &db.cdc_url(),
            &redis.url(),
            &std::env::var("OUTBOXD_BENCH_REDIS").unwrap_or_default(),
        ),
        "store = \"redis\"",
    );
    eos.start();
    eos.stop();
    let eos_key = "outboxd:checkpoint:bench-redis-eos";
    let eos_checkpoint: Vec<u8> = redis.cmd(redis::cmd("GET").arg(eos_key));
    db.sql_socket(&load_script(from, from + n, 10));
    let target = gtid_pos(db);
    let body = payload(0, 0);
    let mut drains = Vec::new();
    let mut eos_drains = Vec::new();
    let mut raws = Vec::new();
    for _ in 0..REPEATS {
        redis.cmd::<()>(redis::cmd("DEL").arg(TOPIC));
        std::fs::write(outboxd.checkpoint_path(), &checkpoint).unwrap();
        drains.push(timed_run(
            &mut outboxd,
            "outboxd to drain into Redis",
            at_gtid(&target),
        ));
        redis.cmd::<()>(redis::cmd("DEL").arg(TOPIC));
        redis.cmd::<()>(redis::cmd("SET").arg(eos_key).arg(&eos_checkpoint));
        eos_drains.push(timed_run(
            &mut eos,
            "outboxd to drain into Redis exactly once",
            |_| {
                let stored: Vec<u8> = redis.cmd(redis::cmd("GET").arg(eos_key));
                serde_json::from_slice::<serde_json::Value>(&stored).unwrap()["position"]
                    ["gtid_set"]
                    == target.as_str()
            },
        ));
        redis.cmd::<()>(redis::cmd("DEL").arg(TOPIC));
        let start = Instant::now();
        rt.block_on(redis_alone(&redis.url(), n, body.as_bytes()));
        raws.push((start.elapsed().as_secs_f64(), ()));
    }
    let (seconds, stats, spread) = median(drains, n);
    let (eos_seconds, eos_stats, eos_spread) = median(eos_drains, n);
    let (raw_seconds, (), raw_spread) = median(raws, n);
    vec![
        Row {
            key: "redis",
            what: "outboxd → Redis 7.0 Streams (appendfsync always), MariaDB backlog drain, 10-row transactions".into(),
            events: n,
            seconds,
            bytes: n * record_bytes,
            extra: format!(
                "{spread}; {:.1} CPU s, peak RSS {:.0} MB, open {:.2} s",
                stats.cpu_seconds, stats.peak_rss_mb, stats.open_seconds
            ),
        },
        Row {
            key: "redis-eos",
            what: "the same drain exactly once (checkpoint.store = \"redis\": entries and checkpoint in one MULTI/EXEC per commit)".into(),
            events: n,
            seconds: eos_seconds,
            bytes: n * record_bytes,
            extra: format!(
                "{eos_spread}; {:.1} CPU s, peak RSS {:.0} MB",
                eos_stats.cpu_seconds, eos_stats.peak_rss_mb
            ),
        },
        Row {
            key: "redis-raw",
            what: "raw broker: redis-rs alone, same fields, MULTI/EXEC batches of 1,000, one at a time".into(),
            events: n,
            seconds: raw_seconds,
            bytes: n * record_bytes,
            extra: raw_spread,
        },
    ]
}

async fn redis_alone(url: &str, n: u64, body: &[u8]) {
    let client = redis::Client::open(url).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let mut i = 0;
    while i < n {
        let mut pipe = redis::pipe();
        pipe.atomic();
        for j in i..(i + 1000).min(n) {
            pipe.cmd("XADD")
                .arg(TOPIC)
                .arg("*")
                .arg("id")
                .arg(uuid_of(j))
                .arg("outboxd.position")
                .arg(format!("gtid:0-1-{j}"))
                .arg("key")
                .arg(format!("key-{}", j % KEYS))
                .arg("payload")
                .arg(body)
                .arg("timestamp")
                .arg("1764183600000")
                .ignore();
        }
        let () = pipe.query_async(&mut connection).await.unwrap();
        i += 1000;
    }
}
