//! Reading what Kafka holds for the audit, without consuming it: each partition is assigned (no
//! group is joined, no offset is ever committed) and read from the first record at or after the
//! window's start up to the end it had when the read began, `read_committed` (records of aborted
//! transactions are what consumers never see; an exactly-once pipeline's retries leave them).

use std::time::{Duration, Instant};

use rdkafka::bindings as rd;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use std::collections::{BTreeSet, HashMap};

use super::matching::Matcher;
use super::tally::{BrokerRead, Read, Tally};
use crate::checkpoint::{is_connection_property, QuietContext};
use crate::error::{Error, Result};
use crate::route::{ID_HEADER, POSITION_HEADER};

/// The header every dead letter carries (its reason).
const DEAD_LETTER_ERROR_HEADER: &str = "outboxd.error";
use crate::sink::kafka::config::KafkaConfig;
use crate::sink::kafka::described_value;

/// The longest one metadata, watermark or offset lookup may take.
const LOOKUP: Duration = Duration::from_secs(30);
/// The longest a topic may stay silent before its end while it is read.
const SILENCE: Duration = Duration::from_secs(60);
/// The longest a partition is waited for at an open transaction (outboxd's own, in exactly-once
/// mode, commits within a second or so; another producer's may stay open for its
/// `transaction.timeout.ms`).
const STABLE: Duration = Duration::from_secs(30);
/// A window starts this much earlier on the brokers: a record's timestamp may be the broker's
/// append time, or a commit time behind the column's.
const SKEW_MS: i64 = 300_000;

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
            Some(mut read) => {
                read.compacted = reader.compacted(topic);
                tally.out.topics.push(topic.clone());
                if let Some(until) = read.until() {
                    tally.matcher.partial(topic, until);
                }
                tally.out.notes.extend(read.notes(topic));
            }
            None => tally.out.absent_topics.push(topic.clone()),
        }
    }
    if let Some(dlq) = &kafka.dead_letter_topic {
        if let Some(mut read) = reader.topic(dlq, since_ms, &mut |r| tally.dead_letter(r))? {
            read.compacted = reader.compacted(dlq);
            if let Some(until) = read.until() {
                tally.matcher.partial_dead_letters(until);
            }
            tally.out.notes.extend(read.notes(dlq));
        }
    }
    Ok(tally.finish())
}

/// Reads topics, each with a consumer of its own (nothing of one topic's assignment, buffered
/// records or end markers, can reach the next).
struct Reader {
    config: ClientConfig,
    /// The same, `read_uncommitted`: its high watermark is the partition's true end, past any
    /// open transaction (where `read_committed`'s last stable offset stops).
    uncommitted: ClientConfig,
    /// The connection alone (an admin client takes no consumer settings).
    admin: ClientConfig,
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
            .set("client.id", format!("outboxd-{pipeline}-audit"));
        let admin = config.clone();
        config
            // Needed by librdkafka for a consumer; never joined (partitions are assigned) and never
            // committed to.
            .set("group.id", format!("outboxd.{pipeline}.audit"))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true")
            // A start offset retention removed meanwhile is an error, never a silent jump to the
            // partition's end.
            .set("auto.offset.reset", "error")
            .set("isolation.level", "read_committed")
            .set("fetch.wait.max.ms", "50")
            .set("max.partition.fetch.bytes", "16777216");
        let mut uncommitted = config.clone();
        uncommitted.set("isolation.level", "read_uncommitted");
        Reader {
            config,
            uncommitted,
            admin,
            brokers: kafka.brokers.clone(),
        }
    }

    /// Every record of `topic` from `since_ms` (all without) to the end each partition had when
    /// this call began, each partition in offset order; `None` when the brokers lack the topic.
    fn topic(
        &self,
        topic: &str,
        since_ms: Option<i64>,
        each: &mut dyn FnMut(Read<'_>),
    ) -> Result<Option<TopicRead>> {
        let consumer: BaseConsumer<QuietContext> = self
            .config
            .create_with_context(QuietContext::default())
            .map_err(|e| failed(&self.brokers, "creating a consumer", &e))?;
        let Some(partitions) = self.partitions(&consumer, topic)? else {
            return Ok(None);
        };
        let what = |w: &str| format!("{w} of {topic:?}");
        let mut read = TopicRead::default();
        // Where each partition's read ends (exclusive): its end when the read began.
        let mut ends: HashMap<i32, i64> = HashMap::new();
        // Where each partition's read begins.
        let mut firsts: HashMap<i32, i64> = HashMap::new();
        let mut assignment = TopicPartitionList::new();
        for start in self.starts(topic, partitions, since_ms)? {
            if start.low > 0 && (since_ms.is_none() || start.first == start.low) {
                read.truncated.push(start.partition);
            }
            if start.first < start.high {
                ends.insert(start.partition, start.high);
                firsts.insert(start.partition, start.first);
                assignment
                    .add_partition_offset(topic, start.partition, Offset::Offset(start.first))
                    .map_err(|e| failed(&self.brokers, &what("assigning"), &e))?;
            }
        }
        if ends.is_empty() {
            return Ok(Some(read));
        }
        consumer
            .assign(&assignment)
            .map_err(|e| failed(&self.brokers, &what("assigning"), &e))?;
        self.drain(&consumer, topic, (&firsts, ends), &mut read, each)?;
        Ok(Some(read))
    }

    /// Reads the assigned partitions of `topic` to their `ends`. A partition that stops short of
    /// its end (its last stable offset: a transaction open there) is waited for up to [`STABLE`],
    /// then left unread past it (`read.unstable`). A partition read to its end is paused, so only
    /// the partitions still being read count as heard from.
    fn drain(
        &self,
        consumer: &BaseConsumer<QuietContext>,
        topic: &str,
        (firsts, mut ends): (&HashMap<i32, i64>, HashMap<i32, i64>),
        read: &mut TopicRead,
        each: &mut dyn FnMut(Read<'_>),
    ) -> Result<()> {
        let what = |w: &str| format!("{w} of {topic:?}");
        // Where a partition's read stands; before its first record, where it began.
        let at = |partition: i32| {
            self.position(consumer, topic, partition)
                .or_else(|| firsts.get(&partition).copied())
        };
        let pause = |partition: i32| {
            let mut done = TopicPartitionList::new();
            done.add_partition(topic, partition);
            let _ = consumer.pause(&done);
        };
        // Partitions at their last stable offset, below their end, and since when.
        let mut stalled: HashMap<i32, Instant> = HashMap::new();
        let mut heard = Instant::now();
        while !ends.is_empty() {
            ends.retain(|partition, _| {
                let open = stalled.get(partition).is_some_and(|t| t.elapsed() > STABLE);
                if open {
                    read.unstable.push(*partition);
                    pause(*partition);
                }
                !open
            });
            let Some(next) = consumer.poll(Duration::from_millis(500)) else {
                let moving = ends.keys().any(|p| !stalled.contains_key(p));
                if moving && heard.elapsed() > SILENCE {
                    // librdkafka signals no end where a read begins beyond an open transaction's
                    // start: a partition whose last stable offset (a read_committed consumer's
                    // high watermark) is not past where the read stands is held there, not
                    // silent.
                    // One deadline for them all, and the first lookup that fails ends it: a
                    // broker that does not answer is the error below.
                    let mut held = false;
                    let silent: Vec<i32> = ends
                        .keys()
                        .filter(|p| !stalled.contains_key(p))
                        .copied()
                        .collect();
                    let deadline = Instant::now() + LOOKUP;
                    for partition in silent {
                        let left = deadline.saturating_duration_since(Instant::now());
                        let Ok((_, stable)) = consumer.fetch_watermarks(topic, partition, left)
                        else {
                            held = false;
                            break;
                        };
                        if at(partition).is_some_and(|at| stable <= at) {
                            stalled.insert(partition, Instant::now());
                            held = true;
                        }
                    }
                    if held {
                        heard = Instant::now();
                        continue;
                    }
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
            let message = match next {
                Ok(m) => m,
                // A partition's end: with read_committed, its last stable offset. Below the end
                // the read began with, a transaction is open there.
                Err(KafkaError::PartitionEOF(partition)) => {
                    if let Some(&end) = ends.get(&partition) {
                        if at(partition).is_none_or(|at| at >= end) {
                            ends.remove(&partition);
                            pause(partition);
                        } else {
                            stalled.entry(partition).or_insert_with(Instant::now);
                        }
                    }
                    continue;
                }
                Err(e) => return Err(failed(&self.brokers, &what("reading"), &e)),
            };
            let partition = message.partition();
            let Some(&end) = ends.get(&partition) else {
                continue;
            };
            heard = Instant::now();
            stalled.remove(&partition);
            // The cut-off comes from outboxd's own records (a row's, or a dead letter: it has
            // no id but an error): another producer's (a backfill, a skewed host) may carry any
            // time.
            if !read.first_stamp.contains_key(&partition)
                && header_of(&message, POSITION_HEADER).is_some()
                && (header_of(&message, ID_HEADER).is_some()
                    || header_of(&message, DEAD_LETTER_ERROR_HEADER).is_some())
            {
                read.first_stamp
                    .insert(partition, message.timestamp().to_millis());
            }
            if message.offset() < end {
                let header = |name: &str| header_of(&message, name);
                each(Read {
                    topic,
                    partition,
                    offset: message.offset(),
                    key: message.key(),
                    value: message.payload(),
                    timestamp: message.timestamp().to_millis(),
                    header: &header,
                });
            }
            if message.offset() + 1 >= end {
                ends.remove(&partition);
                pause(partition);
            }
        }
        Ok(())
    }

    /// Whether `topic` is compacted (`cleanup.policy` names `compact`): the brokers then remove
    /// older records of a key. `None` when they would not say (no DescribeConfigs grant).
    fn compacted(&self, topic: &str) -> Option<bool> {
        let admin: rdkafka::admin::AdminClient<QuietContext> = self
            .admin
            .create_with_context(QuietContext::default())
            .ok()?;
        let resource = rdkafka::admin::ResourceSpecifier::Topic(topic);
        let policy = described_value(&admin, &resource, "cleanup.policy", LOOKUP)?;
        Some(policy.contains("compact"))
    }

    /// Where the consumer is in `partition` (after an end marker: the last stable offset).
    fn position(
        &self,
        consumer: &BaseConsumer<QuietContext>,
        topic: &str,
        partition: i32,
    ) -> Option<i64> {
        let positions = consumer.position().ok()?;
        match positions.find_partition(topic, partition)?.offset() {
            Offset::Offset(at) => Some(at),
            _ => None,
        }
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

    /// Per partition: the first offset to read (the first record stamped at or after
    /// `since_ms` less [`SKEW_MS`], else the partition's start) and its ends.
    fn starts(&self, topic: &str, partitions: i32, since_ms: Option<i64>) -> Result<Vec<Start>> {
        let what = |w: &str| format!("{w} of {topic:?}");
        // The true end and the window's start: read_committed's answers stop at an open
        // transaction (a lookup past it finds nothing).
        let uncommitted: BaseConsumer<QuietContext> = self
            .uncommitted
            .create_with_context(QuietContext::default())
            .map_err(|e| failed(&self.brokers, "creating a consumer", &e))?;
        let mut found = None;
        if let Some(ms) = since_ms {
            let mut at = TopicPartitionList::new();
            for partition in 0..partitions {
                at.add_partition_offset(topic, partition, Offset::Offset((ms - SKEW_MS).max(0)))
                    .map_err(|e| failed(&self.brokers, &what("looking up the window"), &e))?;
            }
            found = Some(
                uncommitted
                    .offsets_for_times(at, LOOKUP)
                    .map_err(|e| failed(&self.brokers, &what("looking up the window"), &e))?,
            );
        }
        let mut starts = Vec::with_capacity(partitions as usize);
        for partition in 0..partitions {
            let (low, high) = uncommitted
                .fetch_watermarks(topic, partition, LOOKUP)
                .map_err(|e| failed(&self.brokers, &what("reading the watermarks"), &e))?;
            let first = match found.as_ref().map(|f| f.find_partition(topic, partition)) {
                None => low,
                Some(None) => {
                    return Err(Error::sink(format!(
                        "audit: the brokers gave no offset for the window's start in {topic:?} partition {partition}"
                    ))
                    .transient())
                }
                Some(Some(p)) => {
                    if let Err(e) = p.error() {
                        return Err(failed(&self.brokers, &what("looking up the window"), &e));
                    }
                    match p.offset() {
                        Offset::Offset(o) => o.max(low),
                        // No record stamped at or after the window's start.
                        _ => high,
                    }
                }
            };
            starts.push(Start {
                partition,
                first,
                low,
                high,
            });
        }
        Ok(starts)
    }
}

/// Where a partition's read starts, and its watermarks when it began.
struct Start {
    partition: i32,
    first: i64,
    low: i64,
    high: i64,
}

/// What reading one topic found besides its records.
#[derive(Default)]
struct TopicRead {
    /// Partitions whose records no longer start at offset 0 (retention or deleted records).
    truncated: Vec<i32>,
    /// Partitions whose read stopped at an open transaction, before the end.
    unstable: Vec<i32>,
    /// Whether the topic is compacted (`None`: the brokers would not say).
    compacted: Option<bool>,
    /// Per partition, the timestamp of the first record of outboxd's read (`None`: it had none).
    first_stamp: HashMap<i32, Option<i64>>,
}

impl TopicRead {
    /// Until when (ms, `i64::MAX`: any time) the brokers may no longer show a record the topic
    /// took; `None` when they show them all. Retention deletes the oldest records: a record
    /// stamped after a truncated partition's first remaining one (less [`SKEW_MS`]) is still
    /// there. Compaction and an open transaction can hide a record of any time.
    fn until(&self) -> Option<i64> {
        if !self.unstable.is_empty() || self.compacted == Some(true) {
            return Some(i64::MAX);
        }
        self.truncated
            .iter()
            .map(|p| match self.first_stamp.get(p).copied().flatten() {
                Some(stamp) => stamp.saturating_add(SKEW_MS),
                None => i64::MAX,
            })
            .max()
    }

    fn notes(&self, topic: &str) -> Vec<String> {
        let mut notes = Vec::new();
        let unverifiable = "a row without a record there is unverifiable, not missing";
        if !self.truncated.is_empty() {
            notes.push(format!(
                "{topic:?} partition(s) {:?} no longer hold their first records (retention or deleted records): {unverifiable} when it is older than the oldest record left",
                self.truncated
            ));
        }
        match self.compacted {
            Some(true) => notes.push(format!(
                "{topic:?} is compacted (cleanup.policy): the brokers remove older records of a key, so {unverifiable}"
            )),
            Some(false) => {}
            None => notes.push(format!(
                "the brokers would not say whether {topic:?} is compacted (grant the audit's user DescribeConfigs on it): if it is, a missing row may have been compacted away"
            )),
        }
        if !self.unstable.is_empty() {
            notes.push(format!(
                "{topic:?} partition(s) {:?} hold a transaction open for over {}: records after it were not read, so {unverifiable} (run the audit again once it ends)",
                self.unstable,
                humantime::format_duration(STABLE)
            ));
        }
        notes
    }
}

/// The first value of header `name` of `message` (as the rest of outboxd reads headers), looked
/// up by name alone: the rdkafka crate's header iterator panics on a header name that is not
/// UTF-8, which any producer may write, and one such record would stop every audit. A header
/// without a value counts as absent.
fn header_of<'a>(message: &'a BorrowedMessage<'_>, name: &str) -> Option<&'a [u8]> {
    let name = std::ffi::CString::new(name).ok()?;
    let mut headers: *mut rd::rd_kafka_headers_t = std::ptr::null_mut();
    let mut value: *const std::ffi::c_void = std::ptr::null();
    let mut size = 0usize;
    // SAFETY: the message is valid for 'a, and librdkafka keeps its headers (and the value a
    // lookup points into) as long as the message. The first call parses the headers into the
    // message, so two threads must not ask one message at once; the audit reads on one thread.
    unsafe {
        if rd::rd_kafka_message_headers(message.ptr(), &mut headers)
            != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
        {
            return None;
        }
        if rd::rd_kafka_header_get(headers, 0, name.as_ptr(), &mut value, &mut size)
            != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
            || value.is_null()
        {
            return None;
        }
        Some(std::slice::from_raw_parts(value.cast::<u8>(), size))
    }
}
