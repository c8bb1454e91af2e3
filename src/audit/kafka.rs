//! Reading what Kafka holds for the audit, without consuming it: each partition is assigned (no
//! group is joined, no offset is ever committed) and read from the first record at or after the
//! window's start up to the end it had when the read began, `read_committed` (records of aborted
//! transactions are what consumers never see; an exactly-once pipeline's retries leave them).

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use std::collections::BTreeSet;

use super::matching::Matcher;
use super::tally::{BrokerRead, Read, Tally};
use crate::checkpoint::{is_connection_property, QuietContext};
use crate::error::{Error, Result};
use crate::sink::kafka::config::KafkaConfig;

/// Reads every topic of `topics` (and the dead-letter topic) into `tally`.
pub fn read(
    kafka: &KafkaConfig,
    pipeline: &str,
    topics: &BTreeSet<String>,
    mut tally: Tally,
) -> Result<(Matcher, BrokerRead)> {
    let reader = Reader::connect(kafka, pipeline)?;
    let since_ms = tally.since_ms();
    for topic in topics {
        let Some(partitions) = reader.partitions(topic)? else {
            tally.out.absent_topics.push(topic.clone());
            continue;
        };
        tally.out.topics.push(topic.clone());
        for partition in 0..partitions {
            reader.read(topic, partition, since_ms, &mut |r| tally.record(r))?;
        }
    }
    if let Some(dlq) = &kafka.dead_letter_topic {
        if let Some(partitions) = reader.partitions(dlq)? {
            for partition in 0..partitions {
                reader.read(dlq, partition, since_ms, &mut |r| tally.dead_letter(r))?;
            }
        }
    }
    Ok(tally.finish())
}

/// The longest one metadata, watermark or offset lookup may take.
const LOOKUP: Duration = Duration::from_secs(30);
/// The longest a partition may stay silent before its end while it is read.
const SILENCE: Duration = Duration::from_secs(60);

/// Whether `topic` exists, and then every record of it from `since_ms` (all without) to its end,
/// partition by partition, in offset order.
struct Reader {
    consumer: BaseConsumer<QuietContext>,
    brokers: String,
}

fn failed(brokers: &str, what: &str, e: &KafkaError) -> Error {
    Error::sink(format!("audit: {what} on {brokers} failed: {e}"))
        .remedy("check that the brokers are reachable and the user may Describe and Read the topics (a consumer's grants; the audit never writes)")
        .transient()
}

impl Reader {
    pub fn connect(kafka: &KafkaConfig, pipeline: &str) -> Result<Reader> {
        let mut config = ClientConfig::new();
        for (key, value) in &kafka.properties {
            if is_connection_property(key) {
                config.set(key, value);
            }
        }
        config
            .set("bootstrap.servers", &kafka.brokers)
            .set("client.id", format!("outboxd-{pipeline}-audit"))
            // Needed by librdkafka for a consumer; never joined (partitions are assigned) and never
            // committed to.
            .set("group.id", format!("outboxd.{pipeline}.audit"))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true")
            .set("isolation.level", "read_committed")
            .set("fetch.wait.max.ms", "50")
            .set("max.partition.fetch.bytes", "16777216");
        let consumer = config
            .create_with_context(QuietContext::default())
            .map_err(|e| failed(&kafka.brokers, "creating a consumer", &e))?;
        Ok(Reader {
            consumer,
            brokers: kafka.brokers.clone(),
        })
    }

    /// The partition count of `topic`, `None` when the brokers do not have it.
    pub fn partitions(&self, topic: &str) -> Result<Option<i32>> {
        let meta = self
            .consumer
            .fetch_metadata(Some(topic), LOOKUP)
            .map_err(|e| failed(&self.brokers, &format!("reading {topic:?}'s metadata"), &e))?;
        let Some(found) = meta.topics().iter().find(|t| t.name() == topic) else {
            return Ok(None);
        };
        match found.error() {
            None => Ok(Some(found.partitions().len() as i32)),
            Some(code)
                if RDKafkaErrorCode::from(code) == RDKafkaErrorCode::UnknownTopicOrPartition =>
            {
                Ok(None)
            }
            Some(code) => Err(Error::sink(format!(
                "audit: the brokers refused {topic:?}'s metadata: {:?}",
                RDKafkaErrorCode::from(code)
            ))
            .remedy("grant the audit's user Describe and Read on the topic")),
        }
    }

    /// Calls `each` for every record of `topic`'s partition from `since_ms` to the end the
    /// partition had when this call began; returns the records read.
    pub fn read(
        &self,
        topic: &str,
        partition: i32,
        since_ms: Option<i64>,
        each: &mut dyn FnMut(Read<'_>),
    ) -> Result<u64> {
        let what = |w: &str| format!("{w} of {topic:?} partition {partition}");
        let (low, high) = self
            .consumer
            .fetch_watermarks(topic, partition, LOOKUP)
            .map_err(|e| failed(&self.brokers, &what("reading the watermarks"), &e))?;
        let mut start = Offset::Offset(low);
        if let Some(ms) = since_ms {
            let mut at = TopicPartitionList::new();
            at.add_partition_offset(topic, partition, Offset::Offset(ms))
                .map_err(|e| failed(&self.brokers, &what("looking up the window"), &e))?;
            let found = self
                .consumer
                .offsets_for_times(at, LOOKUP)
                .map_err(|e| failed(&self.brokers, &what("looking up the window"), &e))?;
            start = found
                .find_partition(topic, partition)
                .map_or(Offset::End, |p| p.offset());
        }
        let first = match start {
            Offset::Offset(o) if o < high => o.max(low),
            // No record at or after the window's start.
            _ => return Ok(0),
        };
        if first >= high {
            return Ok(0);
        }
        let mut assignment = TopicPartitionList::new();
        assignment
            .add_partition_offset(topic, partition, Offset::Offset(first))
            .map_err(|e| failed(&self.brokers, &what("assigning"), &e))?;
        self.consumer
            .assign(&assignment)
            .map_err(|e| failed(&self.brokers, &what("assigning"), &e))?;
        let mut count = 0;
        let mut heard = Instant::now();
        loop {
            let Some(next) = self.consumer.poll(Duration::from_millis(500)) else {
                if heard.elapsed() > SILENCE {
                    return Err(Error::sink(format!(
                        "audit: {} returned nothing for {} before reaching offset {high}",
                        what("reading"),
                        humantime::format_duration(SILENCE)
                    ))
                    .remedy("check the brokers (an unavailable partition leader, a frozen broker) and run the audit again")
                    .transient());
                }
                continue;
            };
            heard = Instant::now();
            let message = match next {
                Ok(m) => m,
                // The end (with read_committed, the last stable offset): done.
                Err(KafkaError::PartitionEOF(_)) => break,
                Err(e) => return Err(failed(&self.brokers, &what("reading"), &e)),
            };
            if message.topic() != topic || message.partition() != partition {
                continue;
            }
            if message.offset() >= high {
                break;
            }
            count += 1;
            let headers = message.headers();
            let header = move |name: &str| -> Option<&[u8]> {
                headers.and_then(|h| h.iter().find(|h| h.key == name).and_then(|h| h.value))
            };
            each(Read {
                topic,
                partition,
                offset: message.offset(),
                key: message.key(),
                value: message.payload(),
                timestamp: message.timestamp().to_millis(),
                header: &header,
            });
            if message.offset() + 1 >= high {
                break;
            }
        }
        let _ = self.consumer.unassign();
        Ok(count)
    }
}
