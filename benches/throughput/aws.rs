//! The SQS and SNS sinks (`--only aws`), on a private moto server.
//!
//! moto is a Python server, so a drain's rate here is moto's, a floor, not outboxd's. What is
//! outboxd's is the CPU it spends per 1,000 messages: measured for a backlog drained into a
//! standard SNS topic, beside the AWS SDK for Rust alone publishing the same messages to the same
//! topic (`PublishBatch` of 10, 10 batches in flight, as the lane does), interleaved run by run.
//! SNS, not SQS: moto's `SendMessageBatch` costs time in proportion to the messages the queue
//! holds (1,000 messages take 10 s, 3,000 take 84 s) and its `PurgeQueue` works once a minute, so
//! a queue cannot be drained into at any size worth measuring; a topic without subscribers keeps
//! nothing. The SQS and SNS sinks share everything but the request types (`lane.rs`).
//! outboxd's CPU is the whole pipeline's (binlog read and decode, routing, checkpoints,
//! start-up); the SDK's is only building and sending, so the difference is not the sink's
//! overhead alone.

use std::time::Instant;

use futures_util::stream::{self, StreamExt};

use super::rig::moto::{config_with_aws, Moto};
use super::rig::scenario::uuid_of;
use super::rig::{Mysqld, Outboxd};
use super::{
    at_gtid, first_checkpoint, gtid_pos, load_script, median, payload, stat_cpu_seconds, timed_run,
    Row,
};
use super::{ProcessStats, KEYS, REPEATS};

/// The topic the route names (`outbox-event-order`: SNS takes no dots).
const NAME: &str = "outbox-event-order";

/// Rows drained per run.
pub fn rows(quick: bool) -> u64 {
    if quick {
        5_000
    } else {
        20_000
    }
}

pub fn section(
    db: &Mysqld,
    rt: &tokio::runtime::Runtime,
    from: u64,
    n: u64,
    record_bytes: u64,
) -> Vec<Row> {
    let moto = Moto::start();
    let arn = moto.create_topic(NAME);
    let mut outboxd = Outboxd::new(
        "bench-sns",
        &format!(
            "{}\n[route]\ntopic = \"outbox-event-${{routedByValue}}\"\n",
            config_with_aws(&db.cdc_url(), "sns", &moto.endpoint(), "")
        ),
    );
    outboxd.env = Moto::env();
    let checkpoint = first_checkpoint(&mut outboxd);
    db.sql_socket(&load_script(from, from + n, 10));
    let target = gtid_pos(db);
    let client = moto.sns();
    let (mut drains, mut alone) = (Vec::new(), Vec::new());
    for _ in 0..REPEATS {
        std::fs::write(outboxd.checkpoint_path(), &checkpoint).unwrap();
        drains.push(timed_run(
            &mut outboxd,
            "outboxd to drain into SNS",
            at_gtid(&target),
        ));
        let cpu = stat_cpu_seconds("self", false);
        let start = Instant::now();
        rt.block_on(sdk_alone(&client, &arn, from, n));
        let seconds = start.elapsed().as_secs_f64();
        alone.push((seconds, stat_cpu_seconds("self", false) - cpu));
    }
    // CPU seconds for n messages as milliseconds per 1,000.
    let per_1000 = |cpu: f64| cpu * 1e6 / n as f64;
    let (seconds, stats, spread): (f64, ProcessStats, String) = median(drains, n);
    let (alone_seconds, alone_cpu, alone_spread) = median(alone, n);
    vec![
        Row {
            key: "sns",
            what: "outboxd → SNS (moto 5.2, standard topic without subscribers), MariaDB backlog drain, 10-row transactions: the rate is moto's".into(),
            events: n,
            seconds,
            bytes: n * record_bytes,
            extra: format!(
                "{spread}; {:.0} CPU ms per 1,000 messages ({:.1} CPU s), peak RSS {:.0} MB",
                per_1000(stats.cpu_seconds),
                stats.cpu_seconds,
                stats.peak_rss_mb
            ),
        },
        Row {
            key: "sns-raw",
            what: "the AWS SDK for Rust alone: the same messages, PublishBatch of 10, 10 in flight (no database, no checkpoint: only building and sending)".into(),
            events: n,
            seconds: alone_seconds,
            bytes: n * record_bytes,
            extra: format!(
                "{alone_spread}; {:.0} CPU ms per 1,000 messages (the benchmark process)",
                per_1000(alone_cpu)
            ),
        },
    ]
}

/// Publishes rows `from..from + n` as outboxd's messages (the payload as body; the id, the key
/// and the position as attributes) in batches of 10, 10 batches in flight.
async fn sdk_alone(client: &aws_sdk_sns::Client, arn: &str, from: u64, n: u64) {
    use aws_sdk_sns::types::{MessageAttributeValue, PublishBatchRequestEntry};
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
                PublishBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message(payload(j, 0))
                    .message_attributes("id", text(uuid_of(j)))
                    .message_attributes("outboxd.key", text(format!("key-{}", j % KEYS)))
                    .message_attributes("outboxd.position", text(format!("gtid:0-1-{j}")))
                    .build()
                    .unwrap()
            })
            .collect();
        client
            .publish_batch()
            .topic_arn(arn)
            .set_publish_batch_request_entries(Some(entries))
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
