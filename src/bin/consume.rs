//! Prints the records of a topic as JSON lines (used by the quickstart to show what outboxd produced).
//!
//! `cargo run --features quickstart --bin consume -- BROKERS TOPIC [COUNT] [SECONDS]`

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 {
        eprintln!("usage: consume BROKERS TOPIC [COUNT] [SECONDS]");
        std::process::exit(2);
    }
    let count: usize = args
        .get(2)
        .map_or(usize::MAX, |c| c.parse().expect("COUNT"));
    let limit = Duration::from_secs(args.get(3).map_or(30, |s| s.parse().expect("SECONDS")));
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &args[0])
        .set("group.id", "outboxd-example-consume")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let start = Instant::now();
    let partitions = loop {
        let meta = consumer
            .fetch_metadata(Some(&args[1]), Duration::from_secs(5))
            .expect("metadata");
        let n = meta.topics().first().map_or(0, |t| t.partitions().len());
        if n > 0 || start.elapsed() > limit {
            break n;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions as i32 {
        tpl.add_partition_offset(&args[1], p, Offset::Beginning)
            .expect("partition");
    }
    consumer.assign(&tpl).expect("assign");
    let mut seen = 0;
    while seen < count && start.elapsed() < limit {
        let Some(message) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = message.expect("consume");
        let text = |b: Option<&[u8]>| b.map(|b| String::from_utf8_lossy(b).into_owned());
        let headers: serde_json::Map<String, serde_json::Value> = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_string(), text(h.value).into()))
                    .collect()
            })
            .unwrap_or_default();
        let line = serde_json::json!({
            "topic": m.topic(),
            "partition": m.partition(),
            "offset": m.offset(),
            "key": text(m.key()),
            "value": text(m.payload()),
            "headers": headers,
        });
        println!("{line}");
        seen += 1;
    }
}
