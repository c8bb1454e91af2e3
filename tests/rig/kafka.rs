//! Reading back what reached the broker, with a real consumer.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
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
    /// The record timestamp (ms since the Unix epoch), if it has one.
    pub timestamp: Option<i64>,
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
    read(client, topic, Stop::Count(expected), limit)
}

/// Everything `topic` holds now: read from the beginning of every partition until each has
/// reported its end (the high watermark; for a `read_committed` client the last stable offset, so
/// an open transaction's records are not waited for), or `limit` passed (a broker out of reach).
/// Callers that wait for records to arrive call it again until they have.
pub fn consume_to_end(client: &[(&str, &str)], topic: &str, limit: Duration) -> Vec<Consumed> {
    read(client, topic, Stop::End, limit)
}

/// How long one [`consume_to_end`] may take: it ends sooner unless the broker is out of reach.
pub const ROUND: Duration = Duration::from_secs(5);

/// Between two rounds of reading a topic to its end, for a caller that waits for records.
pub const PAUSE: Duration = Duration::from_millis(100);

/// When a read stops (besides its time limit).
#[derive(Clone, Copy)]
enum Stop {
    /// Once this many records arrived.
    Count(usize),
    /// Once every partition reported its end.
    End,
}

fn read(client: &[(&str, &str)], topic: &str, stop: Stop, limit: Duration) -> Vec<Consumed> {
    let consumer: BaseConsumer = client
        .iter()
        .fold(&mut ClientConfig::new(), |c, (k, v)| c.set(*k, *v))
        .set("group.id", format!("test-{topic}"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set(
            "enable.partition.eof",
            matches!(stop, Stop::End).to_string(),
        )
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
    let mut ended = std::collections::BTreeSet::new();
    let done = |out: &Vec<Consumed>, ended: &std::collections::BTreeSet<i32>| match stop {
        Stop::Count(expected) => out.len() >= expected,
        Stop::End => ended.len() >= partitions,
    };
    while !done(&out, &ended) && start.elapsed() < limit {
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
                    timestamp: m.timestamp().to_millis(),
                });
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                ended.insert(p);
            }
            // A broker just thawed or restarted drops connections for a moment: librdkafka
            // reconnects by itself, and the caller's count says whether everything arrived.
            Some(Err(e)) if passing(&e) => {}
            Some(Err(e)) => panic!("consumer error: {e}"),
            None => {}
        }
    }
    out
}

/// Records in `topic` right now: the sum of its partitions' high watermarks (from offset 0).
/// A consumer error that a broker restarting, frozen or out of reach causes and librdkafka
/// recovers from by itself.
pub fn passing(e: &rdkafka::error::KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::OperationTimedOut
                | RDKafkaErrorCode::RequestTimedOut
                | RDKafkaErrorCode::NotLeaderForPartition
                | RDKafkaErrorCode::LeaderNotAvailable
        )
    )
}

pub fn topic_end(bootstrap: &str, topic: &str) -> usize {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    let meta = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap();
    let partitions = meta.topics().first().map_or(0, |t| t.partitions().len());
    (0..partitions as i32)
        .map(|p| {
            consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("the watermarks of {topic}/{p}: {e}"))
                .1 as usize
        })
        .sum()
}

/// Produces `(key, value)` pairs to `topic` with Kafka's own Java producer (the console producer of
/// the assembled Apache Kafka: kafka-clients' default partitioner, string serializers). Keys and
/// values must hold no tab or newline.
pub fn java_produce(bootstrap: &str, topic: &str, records: &[(String, String)]) {
    use std::io::Write;
    let lib = super::broker::kafka_home().join("lib/*");
    let mut child = std::process::Command::new("java")
        .args(super::broker::class_data_archive())
        .args(["-XX:TieredStopAtLevel=1", "-cp"])
        .arg(lib)
        .args([
            "org.apache.kafka.tools.ConsoleProducer",
            "--bootstrap-server",
        ])
        .args([bootstrap, "--topic", topic])
        .args(["--reader-property", "parse.key=true"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("java (the console producer)");
    let mut stdin = child.stdin.take().unwrap();
    for (key, value) in records {
        assert!(!format!("{key}{value}").contains(['\t', '\n']));
        writeln!(stdin, "{key}\t{value}").unwrap();
    }
    drop(stdin);
    assert!(
        child.wait().unwrap().success(),
        "the console producer failed"
    );
}

/// Kafka's Java `Utils.murmur2` (the default partitioner's hash), written from its definition for
/// the tests to judge partitions by; checked against the Java client's own test vectors.
pub fn java_murmur2(data: &[u8]) -> i32 {
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = 0x9747_b28c ^ data.len() as u32;
    let whole = data.len() / 4 * 4;
    for chunk in data[..whole].chunks_exact(4) {
        let mut k = u32::from_le_bytes(chunk.try_into().unwrap());
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = &data[whole..];
    if tail.len() == 3 {
        h ^= u32::from(tail[2]) << 16;
    }
    if tail.len() >= 2 {
        h ^= u32::from(tail[1]) << 8;
    }
    if !tail.is_empty() {
        h ^= u32::from(tail[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition Kafka's Java producer picks for `key` among `partitions`.
pub fn java_partition(key: &[u8], partitions: i32) -> i32 {
    (java_murmur2(key) & 0x7fff_ffff) % partitions
}

/// Every keyed record sits on the partition the Java producer would have picked.
pub fn check_java_partitions(records: &[Consumed], partitions: i32) {
    for r in records {
        if let Some(key) = &r.key {
            assert_eq!(
                r.partition,
                java_partition(key, partitions),
                "key {:?} of topic {} is not on its murmur2 partition",
                String::from_utf8_lossy(key),
                r.topic
            );
        }
    }
}
