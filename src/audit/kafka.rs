//! Reading what Kafka holds for the audit, without consuming it: each partition is assigned (no
//! group is joined, no offset is ever committed) and read from the first record at or after the
//! window's start up to the end it had when the read began, `read_committed` (records of aborted
//! transactions are what consumers never see; an exactly-once pipeline's retries leave them).

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use std::collections::{BTreeSet, HashMap};

use super::matching::Matcher;
use super::tally::{BrokerRead, Read, Tally};
use crate::checkpoint::{is_connection_property, QuietContext};
use crate::error::{Error, Result};
use crate::sink::kafka::config::KafkaConfig;

/// The longest one metadata, watermark or offset lookup may take.
const LOOKUP: Duration = Duration::from_secs(30);
/// The longest a topic may stay silent before its end while it is read.
const SILENCE: Duration = Duration::from_secs(60);

/// Reads every topic of `topics` (and the dead-letter topic) into `tally`.
pub fn read(
    kafka: &KafkaConfig,
    pipeline: &str,
    topics: &BTreeSet<String>,
    mut tally: Tally,
) -> Result<(Matcher, BrokerRead)> {
    let reader = Reader::new(kafka, pipeline);
    let since_ms = tally.since_ms();
    for topic in topics {
        match reader.topic(topic, since_ms, &mut |r| tally.record(r))? {
            true => tally.out.topics.push(topic.clone()),
            false => tally.out.absent_topics.push(topic.clone()),
        }
    }
    if let Some(dlq) = &kafka.dead_letter_topic {
        reader.topic(dlq, since_ms, &mut |r| tally.dead_letter(r))?;
    }
    Ok(tally.finish())
}

/// Reads topics, each with a consumer of its own (nothing of one topic's assignment, buffered
/// records or end markers, can reach the next).
struct Reader {
    config: ClientConfig,
    brokers: String,
}

fn failed(brokers: &str, what: &str, e: &KafkaError) -> Error {
    Error::sink(format!("audit: {what} on {brokers} failed: {e}"))
        .remedy("check that the brokers are reachable and the user may Describe and Read the topics (a consumer's grants; the audit never writes)")
        .transient()
}

impl Reader {
    fn new(kafka: &KafkaConfig, pipeline: &str) -> Reader {
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
        Reader {
            config,
            brokers: kafka.brokers.clone(),
        }
    }

    /// Every record of `topic` from `since_ms` (all without) to the end each partition had when
    /// this call began, each partition in offset order; false when the brokers lack the topic.
    fn topic(
        &self,
        topic: &str,
        since_ms: Option<i64>,
        each: &mut dyn FnMut(Read<'_>),
    ) -> Result<bool> {
        let consumer: BaseConsumer<QuietContext> = self
            .config
            .create_with_context(QuietContext::default())
            .map_err(|e| failed(&self.brokers, "creating a consumer", &e))?;
        let Some(partitions) = self.partitions(&consumer, topic)? else {
            return Ok(false);
        };
        let what = |w: &str| format!("{w} of {topic:?}");
        // Where each partition's read starts, and its end (exclusive) when the read began.
        let mut ends: HashMap<i32, i64> = HashMap::new();
        let mut assignment = TopicPartitionList::new();
        let starts = self.starts(&consumer, topic, partitions, since_ms)?;
        for (partition, (first, high)) in starts {
            if first < high {
                ends.insert(partition, high);
                assignment
                    .add_partition_offset(topic, partition, Offset::Offset(first))
                    .map_err(|e| failed(&self.brokers, &what("assigning"), &e))?;
            }
        }
        if ends.is_empty() {
            return Ok(true);
        }
        consumer
            .assign(&assignment)
            .map_err(|e| failed(&self.brokers, &what("assigning"), &e))?;
        let mut heard = Instant::now();
        while !ends.is_empty() {
            let Some(next) = consumer.poll(Duration::from_millis(500)) else {
                if heard.elapsed() > SILENCE {
                    return Err(Error::sink(format!(
                        "audit: {} returned nothing for {} before reaching the end of partition(s) {:?}",
                        what("reading"),
                        humantime::format_duration(SILENCE),
                        ends.keys().collect::<Vec<_>>()
                    ))
                    .remedy("check the brokers (an unavailable partition leader, a frozen broker) and run the audit again")
                    .transient());
                }
                continue;
            };
            heard = Instant::now();
            let message = match next {
                Ok(m) => m,
                // A partition's end (with read_committed, its last stable offset): done with it.
                Err(KafkaError::PartitionEOF(partition)) => {
                    ends.remove(&partition);
                    continue;
                }
                Err(e) => return Err(failed(&self.brokers, &what("reading"), &e)),
            };
            let partition = message.partition();
            let Some(&end) = ends.get(&partition) else {
                continue;
            };
            if message.offset() >= end {
                ends.remove(&partition);
                continue;
            }
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
            if message.offset() + 1 >= end {
                ends.remove(&partition);
            }
        }
        Ok(true)
    }

    /// The partition count of `topic`, `None` when the brokers do not have it.
    fn partitions(
        &self,
        consumer: &BaseConsumer<QuietContext>,
        topic: &str,
    ) -> Result<Option<i32>> {
        let meta = consumer
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

    /// Per partition: the first offset to read (the first record at or after `since_ms`, else
    /// the partition's start) and the end when the read began.
    fn starts(
        &self,
        consumer: &BaseConsumer<QuietContext>,
        topic: &str,
        partitions: i32,
        since_ms: Option<i64>,
    ) -> Result<Vec<(i32, (i64, i64))>> {
        let what = |w: &str| format!("{w} of {topic:?}");
        let mut found = None;
        if let Some(ms) = since_ms {
            let mut at = TopicPartitionList::new();
            for partition in 0..partitions {
                at.add_partition_offset(topic, partition, Offset::Offset(ms))
                    .map_err(|e| failed(&self.brokers, &what("looking up the window"), &e))?;
            }
            found = Some(
                consumer
                    .offsets_for_times(at, LOOKUP)
                    .map_err(|e| failed(&self.brokers, &what("looking up the window"), &e))?,
            );
        }
        let mut starts = Vec::with_capacity(partitions as usize);
        for partition in 0..partitions {
            let (low, high) = consumer
                .fetch_watermarks(topic, partition, LOOKUP)
                .map_err(|e| failed(&self.brokers, &what("reading the watermarks"), &e))?;
            let first = match found.as_ref().map(|f| f.find_partition(topic, partition)) {
                None => low,
                // No record at or after the window's start.
                Some(None) => high,
                Some(Some(p)) => match p.offset() {
                    Offset::Offset(o) => o.max(low),
                    _ => high,
                },
            };
            starts.push((partition, (first, high)));
        }
        Ok(starts)
    }
}
