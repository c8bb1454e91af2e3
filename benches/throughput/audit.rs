//! `--only audit`: how long `outboxd audit` takes, and how much memory it holds, for a table of
//! N rows already delivered, at two sizes (the memory per row is the difference between them).
//! MariaDB to Apache Kafka, the benchmark's ~300-byte rows in 100-row transactions.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::rig::scenario::config_body;
use crate::rig::{wait_until, Broker, Mysqld, Outboxd};

/// Runs `outboxd audit` under `/usr/bin/time -v`: (seconds, peak RSS in MB, the report).
fn timed_audit(outboxd: &Outboxd) -> (f64, f64, serde_json::Value) {
    let mut cmd = Command::new("/usr/bin/time");
    let inner = outboxd.command(&["audit", "--format", "json", "--wait", "5m"]);
    cmd.arg("-v")
        .arg(inner.get_program())
        .args(inner.get_args());
    for (key, value) in inner.get_envs() {
        match value {
            Some(v) => cmd.env(key, v),
            None => cmd.env_remove(key),
        };
    }
    let started = Instant::now();
    let out = cmd.output().unwrap();
    let seconds = started.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let rss_kb: f64 = stderr
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("Maximum resident set size (kbytes): ")
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no peak RSS from /usr/bin/time:\n{stderr}"));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("audit printed no report ({e}):\n{stderr}"));
    (seconds, rss_kb / 1024.0, report)
}

pub fn run(db: &Mysqld, quick: bool) {
    let broker = Broker::start();
    crate::rig::create_topic(&broker.bootstrap(), super::TOPIC, 6);
    let mut outboxd = Outboxd::new(
        "audit",
        &config_body(&db.cdc_url(), &broker.bootstrap(), "", ""),
    );
    outboxd.start();
    let sizes: [u64; 2] = if quick {
        [20_000, 100_000]
    } else {
        [200_000, 1_000_000]
    };
    println!("\n| rows in the outbox table (all delivered) | `outboxd audit` seconds | rows/s | peak RSS |");
    println!("|---:|---:|---:|---:|");
    let mut loaded = 0;
    let mut measured = Vec::new();
    for size in sizes {
        db.sql_socket(&super::load_script(loaded, size, 100));
        loaded = size;
        let target = super::gtid_pos(db);
        wait_until(
            "outboxd to deliver the rows",
            Duration::from_secs(1800),
            || outboxd.checkpoint_or_null()["position"]["gtid_set"] == target,
        );
        let (seconds, rss, report) = timed_audit(&outboxd);
        assert_eq!(report["passed"], true, "{report:#}");
        assert_eq!(report["rows"], size, "{report:#}");
        println!(
            "| {size} | {seconds:.1} | {:.0} | {rss:.0} MB |",
            size as f64 / seconds
        );
        measured.push((size, rss));
    }
    let [(small, low), (large, high)] = [measured[0], measured[1]];
    println!(
        "\nMemory per audited row: {:.0} bytes ((peak RSS at {large} rows - at {small}) / {} rows).",
        (high - low) * 1024.0 * 1024.0 / (large - small) as f64,
        large - small
    );
    outboxd.stop();
}
