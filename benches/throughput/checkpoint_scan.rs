//! `--only checkpoint`: how long `outboxd checkpoint show` takes for a quiet pipeline when other
//! pipelines wrote millions of records to the shared checkpoint topic since its last checkpoint,
//! before compaction ran (its open segment is never compacted; outboxd creates the topic with
//! hour-long segments). A read takes the record the checkpoint's index names (the offset of group
//! `outboxd.quiet.reader`); builds without the index scan back from the end in widening windows
//! until they meet the key. With `--baseline`, that build is timed beside this one at each step.

use std::time::{Duration, Instant};

use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::ClientConfig;

use crate::rig::scenario::config_body;
use crate::rig::{Broker, Mysqld, Outboxd};

const CHECKPOINTS: &str = "outboxd.checkpoints";

/// A lead record of another pipeline, as outboxd writes one (about 90 bytes).
fn renewal(n: u64) -> String {
    format!(
        r#"{{"instance":"host-{}:{}","renewed_at_ms":{},"released":false}}"#,
        n % 7,
        10_000 + n % 1000,
        1_700_000_000_000u64 + n
    )
}

/// Appends `count` renewals of pipeline `busy` to the checkpoint topic.
fn write_renewals(bootstrap: &str, from: u64, count: u64) {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "20")
        .set("batch.size", "1000000")
        .set("queue.buffering.max.messages", "1000000")
        .set("compression.type", "lz4")
        .create()
        .unwrap();
    for n in from..from + count {
        let value = renewal(n);
        let mut record = BaseRecord::<str, str>::to(CHECKPOINTS)
            .key("busy/lead")
            .payload(&value);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((_, back)) => {
                    record = back;
                    producer.poll(Duration::from_millis(5));
                }
            }
        }
        if n % 10_000 == 0 {
            producer.poll(Duration::ZERO);
        }
    }
    producer.flush(Duration::from_secs(120)).unwrap();
}

/// The median of three timed `checkpoint show` runs.
fn timed_show(outboxd: &Outboxd) -> f64 {
    let mut seconds: Vec<f64> = (0..3)
        .map(|_| {
            let started = Instant::now();
            let out = outboxd.command(&["checkpoint", "show"]).output().unwrap();
            let took = started.elapsed().as_secs_f64();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && text.contains("position"),
                "checkpoint show failed: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            took
        })
        .collect();
    seconds.sort_by(f64::total_cmp);
    seconds[1]
}

pub fn run(db: &Mysqld, quick: bool, baseline: Option<&(std::path::PathBuf, String)>) {
    let broker = Broker::start();
    let mut quiet = Outboxd::with_checkpoint(
        "quiet",
        &config_body(&db.cdc_url(), &broker.bootstrap(), "", ""),
        "store = \"kafka\"\n",
    );
    quiet.start();
    quiet.stop();
    // The same pipeline read by the baseline binary (its own config copy, the same topic and key).
    let other = baseline.map(|(path, label)| {
        let mut other = Outboxd::with_checkpoint(
            "quiet",
            &config_body(&db.cdc_url(), &broker.bootstrap(), "", ""),
            "store = \"kafka\"\n",
        );
        other.binary = path.clone();
        (label.clone(), other)
    });
    let steps: &[u64] = if quick {
        &[0, 100_000, 500_000]
    } else {
        &[0, 1_000_000, 5_000_000]
    };
    match &other {
        Some((label, _)) => {
            println!("\n| records of other pipelines after the quiet pipeline's checkpoint | `checkpoint show`, this build (median of 3) | {label} (median of 3) |");
            println!("|---:|---:|---:|");
        }
        None => {
            println!("\n| records of other pipelines after the quiet pipeline's checkpoint | `checkpoint show` (median of 3) |");
            println!("|---:|---:|");
        }
    }
    let mut written = 0;
    for &target in steps {
        write_renewals(&broker.bootstrap(), written, target - written);
        written = target;
        match &other {
            Some((_, other)) => {
                let base = timed_show(other);
                println!("| {target} | {:.2} s | {base:.2} s |", timed_show(&quiet));
            }
            None => println!("| {target} | {:.2} s |", timed_show(&quiet)),
        }
    }
}
