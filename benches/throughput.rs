//! outboxd side by side with the machine's raw limits and with a polling relay, in one run.
//!
//! `cargo bench --bench throughput [-- --quick]` (or `./benches/run.sh [--quick]`): starts a private
//! MariaDB and the nisshi broker like the tests do, then measures, for the same rows:
//! - outboxd draining a preloaded backlog (transactions of 1, 10 and 100 rows): events/s, MB/s, CPU
//!   seconds and peak RSS of the outboxd process (release build, acks=all, real checkpoint writes);
//! - the raw source limit: `mariadb-binlog --read-from-remote-server` reading the same binlog;
//! - the raw broker limit: librdkafka alone producing the same records with acks=all;
//! - a polling relay (`SELECT … ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED`, produce, DELETE,
//!   COMMIT), written fairly: batched, acks=all, same producer settings;
//! - commit→consume latency at fixed offered rates (commit time stamped into the payload by the loader,
//!   receive time taken by a consumer; an upper bound of commit→ack).
//!
//! It prints a Markdown table for BENCHMARKS.md. Numbers are not asserted anywhere.

#[path = "../tests/rig/mod.rs"]
mod rig;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mysql_async::prelude::Queryable;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use rig::scenario::{config_body, uuid_of, SCHEMA};
use rig::{create_topic, wait_until, Broker, MariaDb, Outboxd, Postgres};

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

fn now_micros() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros()
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

struct ProcessStats {
    cpu_seconds: f64,
    peak_rss_mb: f64,
}

fn process_stats(pid: i32) -> ProcessStats {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm_kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    ProcessStats {
        cpu_seconds: ticks / 100.0,
        peak_rss_mb: hwm_kb / 1024.0,
    }
}

/// Starts outboxd, waits until `done(outboxd)` holds, stops it: (seconds, process stats at the end).
fn timed_run(
    outboxd: &mut Outboxd,
    what: &str,
    mut done: impl FnMut(&Outboxd) -> bool,
) -> (f64, ProcessStats) {
    let start = Instant::now();
    outboxd.start();
    let pid = outboxd.pid().as_raw();
    let mut stats = process_stats(pid);
    wait_until(what, Duration::from_secs(1800), || {
        stats = process_stats(pid);
        done(outboxd)
    });
    let seconds = start.elapsed().as_secs_f64();
    outboxd.stop();
    (seconds, stats)
}

/// `done` for [`timed_run`]: the checkpoint reached MariaDB GTID state `target`.
fn at_gtid(target: &str) -> impl FnMut(&Outboxd) -> bool + '_ {
    move |o| o.checkpoint()["position"]["gtid_set"] == target
}

struct Row {
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
    let quick = std::env::args().any(|a| a == "--quick");
    let n: u64 = if quick { 20_000 } else { 200_000 };
    let record_bytes = payload(0, 0).len() as u64 + 40;
    let db = MariaDb::start(&["binlog-row-metadata=FULL"]);
    db.sql_socket(SCHEMA);
    let broker = Broker::start();
    create_topic(&broker.bootstrap(), TOPIC, 6);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut rows: Vec<Row> = Vec::new();

    // outboxd, backlog drain, per transaction size.
    let mut outboxd = Outboxd::new(
        "bench",
        &config_body(&db.cdc_url(), &broker.bootstrap(), "", ""),
    );
    outboxd.start();
    outboxd.stop();
    let mut loaded = 0;
    let mut binlogs = Vec::new();
    for per_txn in [1u64, 10, 100] {
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
        let target = db
            .sql_socket("SELECT @@gtid_binlog_pos;")
            .trim()
            .to_string();
        let (seconds, stats) = timed_run(
            &mut outboxd,
            "outboxd to drain the backlog",
            at_gtid(&target),
        );
        rows.push(Row {
            what: format!("outboxd, backlog drain, {per_txn}-row transactions"),
            events: n,
            seconds,
            bytes: n * record_bytes,
            extra: format!(
                "{:.1} CPU s, peak RSS {:.0} MB",
                stats.cpu_seconds, stats.peak_rss_mb
            ),
        });
    }

    // One huge transaction: memory must not grow with it (rows are streamed, never buffered).
    let huge = if quick { 100_000u64 } else { 1_000_000 };
    db.sql_socket(&format!(
        "INSERT INTO app.outbox (id,aggregatetype,aggregateid,type,payload) \
         SELECT UNHEX(LPAD(HEX(seq + 100000000), 32, '0')), 'huge', CONCAT('key-', seq % {KEYS}), 'Created', REPEAT('x', 250) \
         FROM app.seq_1_to_{huge};"
    ));
    let target = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    let (seconds, stats) = timed_run(
        &mut outboxd,
        "outboxd to pass the huge transaction",
        at_gtid(&target),
    );
    rows.push(Row {
        what: format!("outboxd, one {huge}-row transaction"),
        events: huge,
        seconds,
        bytes: huge * 300,
        extra: format!(
            "peak RSS {:.0} MB (flat: rows are streamed)",
            stats.peak_rss_mb
        ),
    });

    // Raw source limit: the server's own tool reading the same binlog (10-row transactions).
    let (_, file) = &binlogs[1];
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
    assert!(status.success());
    rows.push(Row {
        what: "raw source: mariadb-binlog -v, same binlog (10-row transactions)".into(),
        events: n,
        seconds: start.elapsed().as_secs_f64(),
        bytes: n * record_bytes,
        extra: "decodes every row to text, writes to /dev/null".into(),
    });

    // Raw broker limit: librdkafka alone, same records, acks=all, idempotent.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("queue.buffering.max.messages", "200000")
        .create()
        .unwrap();
    let start = Instant::now();
    rt.block_on(async {
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
    });
    rows.push(Row {
        what: "raw broker: librdkafka producer alone, acks=all".into(),
        events: n,
        seconds: start.elapsed().as_secs_f64(),
        bytes: n * record_bytes,
        extra: "same record size and keys".into(),
    });

    // Polling relay over the rows of the 10-row load (deleting them as it goes).
    db.sql_socket(&format!(
        "DELETE FROM app.outbox WHERE id < UNHEX('{:032x}') OR id >= UNHEX('{:032x}');",
        n,
        2 * n
    ));
    let (relayed, queries, seconds) = rt.block_on(polling_relay(&db, &broker));
    rows.push(Row {
        what: "polling relay: SELECT … LIMIT 500 FOR UPDATE SKIP LOCKED, produce, DELETE, COMMIT"
            .into(),
        events: relayed,
        seconds,
        bytes: relayed * record_bytes,
        extra: format!("{queries} queries"),
    });

    rows.extend(postgres_rows(&broker, n, record_bytes));

    // Latency at offered rates (outboxd running, 1-row transactions).
    let mut latency_rows = Vec::new();
    outboxd.start();
    for rate in [1_000u64, 5_000] {
        let seconds = if quick { 5 } else { 20 };
        let (p50, p99, max, count) = rt.block_on(latency_at(&db, &broker, rate, seconds, loaded));
        loaded += rate * seconds;
        latency_rows.push((rate, p50, p99, max, count));
    }
    outboxd.stop();

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
    let outboxd10 = rows[1].rate();
    println!(
        "\nratios (MariaDB, 10-row transactions): outboxd / raw source = {:.2}, outboxd / raw broker = {:.2}, outboxd / polling relay = {:.1}",
        outboxd10 / rows[4].rate(),
        outboxd10 / rows[5].rate(),
        outboxd10 / rows[6].rate()
    );
    println!(
        "ratios (Postgres, 10-row transactions): outboxd / raw source = {:.2}, outboxd / raw broker = {:.2}",
        rows[7].rate() / rows[8].rate(),
        rows[7].rate() / rows[5].rate()
    );
    println!("\n| offered rate (events/s) | records | p50 ms | p99 ms | max ms |");
    println!("|---:|---:|---:|---:|---:|");
    for (rate, p50, p99, max, count) in latency_rows {
        println!("| {rate} | {count} | {p50:.1} | {p99:.1} | {max:.1} |");
    }
}

async fn polling_relay(db: &MariaDb, broker: &Broker) -> (u64, u64, f64) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .unwrap();
    let mut conn = mysql_async::Conn::from_url(db.root_url()).await.unwrap();
    let start = Instant::now();
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

async fn latency_at(
    db: &MariaDb,
    broker: &Broker,
    rate: u64,
    seconds: u64,
    first: u64,
) -> (f64, f64, f64, usize) {
    let total = rate * seconds;
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("group.id", format!("bench-latency-{rate}"))
        .set("enable.auto.commit", "false")
        // Return fetches as soon as a record is there, so the consumer adds little to the latency.
        .set("fetch.wait.max.ms", "5")
        .set("fetch.min.bytes", "1")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..6 {
        tpl.add_partition_offset(TOPIC, p, Offset::End).unwrap();
    }
    consumer.assign(&tpl).unwrap();
    // The first second warms up (consumer assignment, first fetch): not measured.
    let warm_until = now_micros() + 1_000_000;
    let reader = std::thread::spawn(move || {
        let mut latencies = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(seconds + 60);
        let mut seen = 0;
        while seen < total as usize && Instant::now() < deadline {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                seen += 1;
                let received = now_micros();
                let value: serde_json::Value =
                    serde_json::from_slice(m.payload().unwrap_or(b"{}")).unwrap();
                if let Some(t) = value["t"].as_u64() {
                    if t as u128 > warm_until {
                        latencies.push((received - t as u128) as f64 / 1000.0);
                    }
                }
            }
        }
        latencies
    });
    let mut conn = mysql_async::Conn::from_url(db.root_url()).await.unwrap();
    let tick = Duration::from_millis(10);
    let per_tick = (rate / 100).max(1);
    let start = Instant::now();
    let mut n = first;
    for i in 0..(seconds * 100) {
        let due = start + tick * i as u32;
        tokio::time::sleep_until(tokio::time::Instant::from_std(due)).await;
        let mut script = String::new();
        for _ in 0..per_tick {
            script.push_str(&format!(
                "INSERT INTO app.outbox (id,aggregatetype,aggregateid,type,payload) VALUES (UNHEX('{n:032x}'),'order','key-{}','Created','{}');",
                n % KEYS,
                payload(n, now_micros())
            ));
            n += 1;
        }
        conn.query_drop(script).await.unwrap();
    }
    let mut latencies = reader.join().unwrap();
    latencies.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |p: f64| {
        latencies
            .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN)
    };
    (
        pct(0.5),
        pct(0.99),
        latencies.last().copied().unwrap_or(f64::NAN),
        latencies.len(),
    )
}

/// The same drain against PostgreSQL 15 (pgoutput), and `pg_recvlogical` reading the same WAL.
fn postgres_rows(broker: &Broker, n: u64, record_bytes: u64) -> Vec<Row> {
    let pg = Postgres::start(&[]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql(
        "app",
        "CREATE ROLE cdc WITH LOGIN REPLICATION;
         CREATE TABLE public.outbox (id uuid PRIMARY KEY, aggregatetype text, aggregateid text, type text, payload jsonb);
         ALTER TABLE public.outbox OWNER TO cdc; GRANT CREATE ON DATABASE app TO cdc;",
    );
    let topic = "outbox.event.pgbench";
    create_topic(&broker.bootstrap(), topic, 6);
    let body = format!(
        "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\nheartbeat_interval_ms = 1000\n\
         [kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"\"\n",
        pg.url("cdc", "app"),
        broker.bootstrap()
    );
    let mut outboxd = Outboxd::new("pgbench", &body);
    outboxd.start();
    outboxd.stop();
    pg.sql(
        "app",
        "SELECT pg_create_logical_replication_slot('raw', 'test_decoding');",
    );
    let mut script = String::new();
    let mut m = 0;
    while m < n {
        let values: Vec<String> = (m..(m + 10).min(n))
            .map(|k| {
                format!(
                    "('{}','pgbench','key-{}','Created','{}')",
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
        m += 10;
    }
    pg.sql("app", &script);
    let end = pg
        .sql("app", "SELECT pg_current_wal_lsn();")
        .trim()
        .to_string();

    let probe: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .create()
        .unwrap();
    let (seconds, stats) = timed_run(
        &mut outboxd,
        "outboxd to drain the Postgres backlog",
        |_| {
            let acked: i64 = (0..6)
                .map(|p| {
                    probe
                        .fetch_watermarks(topic, p, Duration::from_secs(5))
                        .map(|w| w.1)
                        .unwrap_or(0)
                })
                .sum();
            acked as u64 >= n
        },
    );

    let start = Instant::now();
    let status = Command::new(format!("{}/pg_recvlogical", rig::postgres::BIN))
        .args([
            "-U",
            "postgres",
            "-d",
            "app",
            "--slot",
            "raw",
            "--start",
            "-f",
            "/dev/null",
        ])
        .arg("-h")
        .arg(pg.dir())
        .args(["-p", &pg.port.to_string(), "--endpos", &end, "--no-loop"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let raw_seconds = start.elapsed().as_secs_f64();
    vec![
        Row {
            what: "outboxd, Postgres backlog drain, 10-row transactions".into(),
            events: n,
            seconds,
            bytes: n * record_bytes,
            extra: format!(
                "{:.1} CPU s, peak RSS {:.0} MB (acked = topic high watermarks)",
                stats.cpu_seconds, stats.peak_rss_mb
            ),
        },
        Row {
            what: "raw source: pg_recvlogical (test_decoding), same WAL".into(),
            events: n,
            seconds: raw_seconds,
            bytes: n * record_bytes,
            extra: "decodes every row to text, writes to /dev/null".into(),
        },
    ]
}
