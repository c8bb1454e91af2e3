//! The SQS and SNS sinks (`--only aws`), on a private moto server.
//!
//! moto is a Python server that answers a few thousand messages a second on one core, so the
//! drain rate here is moto's, a floor, not outboxd's. What is outboxd's is the CPU it spends per
//! 1,000 messages: measured for a backlog drained into a standard SQS queue and into a standard
//! SNS topic, beside the AWS SDK for Rust alone sending the same messages to the same queue
//! (`SendMessageBatch` of 10, 10 batches in flight, as the lane does), interleaved run by run,
//! the queue purged before each.

use std::time::Instant;

use futures_util::stream::{self, StreamExt};

use super::rig::moto::{config_with_aws, Moto};
use super::rig::scenario::uuid_of;
use super::rig::{MariaDb, Outboxd};
use super::{at_gtid, gtid_pos, load_script, median, payload, stat_cpu_seconds, timed_run, Row};
use super::{KEYS, REPEATS};

/// The queue and the topic the route names (`outbox-event-order`: SQS and SNS take no dots).
const NAME: &str = "outbox-event-order";

/// Rows drained per run: moto keeps every message in memory and slows as it holds more.
pub fn rows(quick: bool) -> u64 {
    if quick {
        5_000
    } else {
        20_000
    }
}

pub fn section(
    db: &MariaDb,
    rt: &tokio::runtime::Runtime,
    from: u64,
    n: u64,
    record_bytes: u64,
) -> Vec<Row> {
    let moto = Moto::start();
    let queue = moto.create_queue(NAME, &[]);
    moto.create_topic(NAME);
    let pipeline = |service: &str| {
        let mut outboxd = Outboxd::new(
            &format!("bench-{service}"),
            &format!(
                "{}\n[route]\ntopic = \"outbox-event-${{routedByValue}}\"\n",
                config_with_aws(&db.cdc_url(), service, &moto.endpoint(), "")
            ),
        );
        outboxd.env = Moto::env();
        outboxd.start();
        outboxd.stop();
        let checkpoint = std::fs::read(outboxd.checkpoint_path()).unwrap();
        (outboxd, checkpoint)
    };
    let (mut sqs, sqs_checkpoint) = pipeline("sqs");
    let (mut sns, sns_checkpoint) = pipeline("sns");
    db.sql_socket(&load_script(from, from + n, 10));
    let target = gtid_pos(db);
    let client = moto.sqs();
    let purge = || {
        rt.block_on(client.purge_queue().queue_url(&queue).send())
            .unwrap();
    };
    let (mut sqs_runs, mut sns_runs, mut alone_runs) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..REPEATS {
        purge();
        std::fs::write(sqs.checkpoint_path(), &sqs_checkpoint).unwrap();
        sqs_runs.push(timed_run(
            &mut sqs,
            "outboxd to drain into SQS",
            at_gtid(&target),
        ));
        std::fs::write(sns.checkpoint_path(), &sns_checkpoint).unwrap();
        sns_runs.push(timed_run(
            &mut sns,
            "outboxd to drain into SNS",
            at_gtid(&target),
        ));
        purge();
        let cpu = stat_cpu_seconds("self", false);
        let start = Instant::now();
        rt.block_on(sdk_alone(&client, &queue, from, n));
        let seconds = start.elapsed().as_secs_f64();
        alone_runs.push((seconds, stat_cpu_seconds("self", false) - cpu));
    }
    let per_1000 = |cpu: f64| 1000.0 * cpu * 1000.0 / n as f64;
    let outboxd_row = |key, what: &str, runs: Vec<(f64, super::ProcessStats)>| {
        let (seconds, stats, spread) = median(runs, n);
        Row {
            key,
            what: what.into(),
            events: n,
            seconds,
            bytes: n * record_bytes,
            extra: format!(
                "{spread}; {:.0} CPU ms per 1,000 messages ({:.1} CPU s), peak RSS {:.0} MB",
                per_1000(stats.cpu_seconds),
                stats.cpu_seconds,
                stats.peak_rss_mb
            ),
        }
    };
    let (seconds, cpu, spread) = median(alone_runs, n);
    vec![
        outboxd_row(
            "sqs",
            "outboxd → SQS (moto 5.2, standard queue), MariaDB backlog drain, 10-row transactions: the rate is moto's",
            sqs_runs,
        ),
        outboxd_row(
            "sns",
            "outboxd → SNS (moto 5.2, standard topic), the same drain: the rate is moto's",
            sns_runs,
        ),
        Row {
            key: "sqs-raw",
            what: "the AWS SDK for Rust alone: the same messages, SendMessageBatch of 10, 10 in flight".into(),
            events: n,
            seconds,
            bytes: n * record_bytes,
            extra: format!(
                "{spread}; {:.0} CPU ms per 1,000 messages (the benchmark process)",
                per_1000(cpu)
            ),
        },
    ]
}

/// Sends rows `from..from + n` as outboxd's messages (the payload as body; the id, the key and
/// the position as attributes) in batches of 10, 10 batches in flight.
async fn sdk_alone(client: &aws_sdk_sqs::Client, queue: &str, from: u64, n: u64) {
    use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
    let text = |v: String| {
        MessageAttributeValue::builder()
            .data_type("String")
            .string_value(v)
            .build()
            .unwrap()
    };
    let batches = (from..from + n).step_by(10).map(|first| {
        let entries: Vec<_> = (first..(first + 10).min(from + n))
            .enumerate()
            .map(|(i, j)| {
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(payload(j, 0))
                    .message_attributes("id", text(uuid_of(j)))
                    .message_attributes("outboxd.key", text(format!("key-{}", j % KEYS)))
                    .message_attributes("outboxd.position", text(format!("gtid:0-1-{j}")))
                    .build()
                    .unwrap()
            })
            .collect();
        client
            .send_message_batch()
            .queue_url(queue)
            .set_entries(Some(entries))
            .send()
    });
    stream::iter(batches)
        .buffer_unordered(10)
        .for_each(|reply| async move {
            let reply = reply.unwrap();
            assert!(reply.failed().is_empty(), "{:?}", reply.failed());
        })
        .await;
}
