//! Reading back what reached the broker, with a real consumer.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

#[derive(Debug, Clone)]
pub struct Consumed {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: BTreeMap<String, Option<Vec<u8>>>,
}

impl Consumed {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.as_ref())
            .map(|v| String::from_utf8(v.clone()).unwrap())
    }
}

pub fn create_topic(bootstrap: &str, topic: &str, partitions: i32) {
    create_topic_with(bootstrap, topic, partitions, &[]);
}

pub fn create_topic_with(bootstrap: &str, topic: &str, partitions: i32, config: &[(&str, &str)]) {
    create_topic_using(
        &[("bootstrap.servers", bootstrap)],
        topic,
        partitions,
        config,
    );
}

/// [`create_topic_with`] through a client configured by `client` (e.g. TLS settings).
pub fn create_topic_using(
    client: &[(&str, &str)],
    topic: &str,
    partitions: i32,
    config: &[(&str, &str)],
) {
    let admin: AdminClient<DefaultClientContext> = client
        .iter()
        .fold(&mut ClientConfig::new(), |c, (k, v)| c.set(*k, *v))
        .create()
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let results = rt
        .block_on(admin.create_topics(
            &[config.iter().fold(
                NewTopic::new(topic, partitions, TopicReplication::Fixed(1)),
                |t, (k, v)| t.set(k, v),
            )],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        ))
        .unwrap();
    for r in results {
        r.unwrap();
    }
}

/// Reads `topic` from the beginning of every partition until `expected` records arrived (or `limit`
/// passed; then whatever arrived is returned and the caller's assertion says what is missing).
pub fn consume(bootstrap: &str, topic: &str, expected: usize, limit: Duration) -> Vec<Consumed> {
    consume_using(&[("bootstrap.servers", bootstrap)], topic, expected, limit)
}

/// [`consume`] with a consumer configured by `client` (e.g. TLS settings).
pub fn consume_using(
    client: &[(&str, &str)],
    topic: &str,
    expected: usize,
    limit: Duration,
) -> Vec<Consumed> {
    let consumer: BaseConsumer = client
        .iter()
        .fold(&mut ClientConfig::new(), |c, (k, v)| c.set(*k, *v))
        .set("group.id", format!("test-{topic}"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("fetch.max.bytes", "52428800")
        .set("max.partition.fetch.bytes", "52428800")
        .set("receive.message.max.bytes", "104857600")
        .create()
        .unwrap();
    let start = Instant::now();
    let partitions = loop {
        let meta = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .unwrap();
        let n = meta.topics().first().map_or(0, |t| t.partitions().len());
        if n > 0 {
            break n;
        }
        if start.elapsed() > limit {
            return Vec::new();
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions as i32 {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let mut out = Vec::new();
    while out.len() < expected && start.elapsed() < limit {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let mut headers = BTreeMap::new();
                if let Some(h) = m.headers() {
                    for header in h.iter() {
                        headers.insert(header.key.to_string(), header.value.map(|v| v.to_vec()));
                    }
                }
                out.push(Consumed {
                    topic: m.topic().to_string(),
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(|k| k.to_vec()),
                    value: m.payload().map(|v| v.to_vec()),
                    headers,
                });
            }
            Some(Err(e)) => panic!("consumer error: {e}"),
            None => {}
        }
    }
    out
}
