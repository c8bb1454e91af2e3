//! Reading the live checkpoint through its index (see [`crate::sink::kafka::index`] for why the
//! index exists and how it is written), and telling a lost checkpoint from one never written.
//!
//! The index names one offset. The record there is read with `read_uncommitted`: the index and the
//! record committed in one transaction, so the record is committed, and a reader need not wait for
//! other pipelines' transactions open on the shared partition (the coordinator's stable-offset
//! answer waits for this pipeline's own, which is what matters). When the record is not there:
//! a tombstone that compaction removed is no checkpoint; anything else is a loss, and outboxd
//! stops rather than start over (which would skip, with the MySQL source, every change since).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rdkafka::consumer::Consumer;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::TopicPartitionList;

use rdkafka::consumer::BaseConsumer;
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::Offset;

use super::{group_lookup_error, unreachable, Isolation, KafkaStore, QuietContext, TIMEOUT};
use crate::error::{Error, Result};
use crate::sink::kafka::index::Indexed;

/// How the live checkpoint was found, for `checkpoint show`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// At this offset, named by the index.
    Indexed(i64),
    /// At this offset, by reading the topic back (no index yet).
    Scanned(i64),
}

impl KafkaStore {
    /// The consumer group whose offset is the index.
    pub fn index_group(&self) -> String {
        index_group(&self.name)
    }

    /// The newest committed value of the live key: through the index when there is one; else, or
    /// when the record it names is gone, by reading the topic back.
    pub(super) fn latest_live(&self) -> Result<Option<Vec<u8>>> {
        if self.missing {
            return Ok(None);
        }
        let entry = self.read_index()?;
        let gone = match entry {
            Some(entry) => match self.at_index(entry)? {
                Ok(value) => {
                    *self.found.lock().expect("found lock") = Some(Found::Indexed(entry.offset));
                    return Ok(value);
                }
                Err(gone) => Some((entry, gone)),
            },
            None => None,
        };
        let scanned = self.newest(Isolation::Committed, &self.live_key())?;
        let Some((entry, gone)) = gone else {
            // No index (never written, written before outboxd kept one, or expired).
            let Some((offset, value)) = scanned else {
                return Ok(None);
            };
            *self.found.lock().expect("found lock") = Some(Found::Scanned(offset));
            return Ok(value);
        };
        match scanned {
            // A newer record than the index names: a writer that keeps no index wrote it (an older
            // outboxd, during a rolling upgrade or after a rollback). It is the checkpoint.
            Some((offset, value)) if offset > entry.offset => {
                tracing::warn!(
                    group = self.index_group(),
                    indexed = entry.offset,
                    found = offset,
                    "the checkpoint's index named an older record than the newest one on the topic (an outboxd without the index wrote checkpoints since?): resuming from the newest"
                );
                *self.found.lock().expect("found lock") = Some(Found::Scanned(offset));
                Ok(value)
            }
            // A tombstone (`checkpoint reset`) that compaction removed, and nothing since.
            None if entry.removed => Ok(None),
            // The record the index names is gone and nothing newer exists: lost, whatever older
            // record may remain (a compacted topic removes older records of a key before its newest).
            older => Err(self.lost_error(entry, &gone, older.map(|(offset, _)| offset))),
        }
    }

    /// The index's entry: the group's committed offset on the partition. The checkpoint writer
    /// (which fenced the pipeline's earlier writers) asks for stable offsets: the coordinator then
    /// answers once a transaction of the pipeline still settling has ended. Other readers (`check`,
    /// `checkpoint show`) take what is committed: a killed instance's open transaction, which
    /// only the next leader's fencing ends, would hold them for its whole timeout.
    fn read_index(&self) -> Result<Option<Indexed>> {
        let isolation = if self.settle.load(Ordering::Relaxed) {
            Isolation::Committed
        } else {
            Isolation::Written
        };
        let consumer = self.consumer(isolation)?;
        let mut asked = TopicPartitionList::new();
        asked.add_partition(&self.topic, 0);
        // Asked in short rounds: without a grant on the group, librdkafka retries the coordinator
        // lookup until the timeout and reports the refusal only in the consumer's queue.
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let answer = consumer
                .committed_offsets(asked.clone(), Duration::from_secs(1))
                .and_then(
                    |list| match list.find_partition(&self.topic, 0).map(|p| p.error()) {
                        Some(Err(e)) => Err(e),
                        _ => Ok(list),
                    },
                );
            match answer {
                Ok(list) => return Ok(Indexed::from_committed(&list, &self.topic)),
                Err(e) if group_lookup_error(&e) => return Err(self.group_grant_missing()),
                Err(e)
                    if e.rdkafka_error_code() == Some(RDKafkaErrorCode::OperationTimedOut)
                        && Instant::now() < deadline =>
                {
                    while let Some(event) = consumer.poll(Duration::ZERO) {
                        if event.is_err_and(|e| group_lookup_error(&e)) {
                            return Err(self.group_grant_missing());
                        }
                    }
                }
                Err(e) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::OperationTimedOut) => {
                    return Err(Error::checkpoint(format!(
                        "the checkpoint's index (consumer group {}) did not answer within {TIMEOUT:?}",
                        self.index_group()
                    ))
                    .remedy("outboxd retries; a transaction of this pipeline still settling holds the answer until it ends (at most its transaction.timeout.ms), or the group's coordinator is moving: check the brokers")
                    .transient());
                }
                Err(e) => return Err(unreachable(&self.topic, &e)),
            }
        }
    }

    /// The live value at the index's entry (`Ok`), or what the topic holds instead (`Err`).
    fn at_index(&self, entry: Indexed) -> Result<std::result::Result<Option<Vec<u8>>, String>> {
        let (there, low, high) = self.record_at(entry.offset)?;
        let key = self.live_key();
        Ok(match there {
            Some((offset, k, value)) if offset == entry.offset && k == key.as_bytes() => Ok(value),
            Some((offset, _, _)) if offset == entry.offset => {
                Err("another key's record there".into())
            }
            _ if high <= low => Err("no records at all".into()),
            _ => Err(format!("no such record (offsets {low} to {})", high - 1)),
        })
    }

    /// The checkpoint the index names is gone (`gone`: what the topic holds instead).
    fn lost_error(&self, entry: Indexed, gone: &str, older: Option<i64>) -> Error {
        self.lost.store(true, Ordering::Relaxed);
        let older = match older {
            Some(offset) => format!("; an older record of the pipeline remains at offset {offset}"),
            None => String::new(),
        };
        Error::checkpoint(format!(
            "the checkpoint topic {} lost pipeline {:?}'s checkpoint: its index (consumer group {}) says it was written at offset {}, and the topic holds {gone}{older} (a broker lost the topic's data: one replica, or an unclean leader election)",
            self.topic, self.name, self.index_group(), entry.offset
        ))
        .remedy(format!(
            "outboxd does not start over by itself (with the MySQL source that would skip every change since the lost checkpoint). Put a checkpoint back with `outboxd checkpoint set POSITION` (`outboxd checkpoint list` shows saved ones; or the source position of the last event your consumers have); start anew only if skipping is acceptable, with `outboxd checkpoint reset`. If the index itself is wrong (its group's offsets were changed by hand), remove it instead: kafka-consumer-groups.sh --delete-offsets --group {} --topic {}",
            self.index_group(),
            self.topic
        ))
    }

    /// The first record at or after `offset` (offset, key, value), read by itself, with the
    /// partition's watermarks then: one small fetch (the broker returns at least the batch holding
    /// the offset), not the 16 MiB a scan asks for.
    #[allow(clippy::type_complexity)]
    fn record_at(
        &self,
        offset: i64,
    ) -> Result<(Option<(i64, Vec<u8>, Option<Vec<u8>>)>, i64, i64)> {
        let consumer: BaseConsumer<QuietContext> = self
            .base
            .clone()
            .set("group.id", self.index_group())
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true")
            .set("fetch.wait.max.ms", "10")
            .set("max.partition.fetch.bytes", "65536")
            .set("isolation.level", "read_uncommitted")
            .create_with_context(QuietContext::default())
            .map_err(|e| unreachable(&self.topic, &e))?;
        let (low, high) = consumer
            .fetch_watermarks(&self.topic, 0, TIMEOUT)
            .map_err(|e| unreachable(&self.topic, &e))?;
        if !(low..high).contains(&offset) {
            return Ok((None, low, high));
        }
        let mut assignment = TopicPartitionList::new();
        assignment
            .add_partition_offset(&self.topic, 0, Offset::Offset(offset))
            .and_then(|()| consumer.assign(&assignment))
            .map_err(|e| unreachable(&self.topic, &e))?;
        let deadline = Instant::now() + TIMEOUT;
        while Instant::now() < deadline {
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(message)) => {
                    let record = (
                        message.offset(),
                        message.key().unwrap_or_default().to_vec(),
                        message.payload().map(<[u8]>::to_vec),
                    );
                    return Ok((Some(record), low, high));
                }
                Some(Err(KafkaError::PartitionEOF(_))) => return Ok((None, low, high)),
                Some(Err(e)) if group_lookup_error(&e) => {}
                Some(Err(e)) => return Err(unreachable(&self.topic, &e)),
                None => {}
            }
        }
        Err(Error::checkpoint(format!(
            "reading the checkpoint record at offset {offset} of topic {} took longer than {TIMEOUT:?}",
            self.topic
        ))
        .remedy("outboxd retries; check the brokers")
        .transient())
    }

    /// The refusal of the index's group: outboxd's principal needs READ there.
    pub(super) fn group_grant_missing(&self) -> Error {
        let group = self.index_group();
        Error::checkpoint(format!(
            "outboxd's principal lacks READ on consumer group {group}, where the checkpoint's index is kept"
        ))
        .remedy(format!(
            "grant it: kafka-acls.sh --add --allow-principal User:<outboxd's user> --operation Read --group {group}"
        ))
    }

    /// The last read found the index naming a record the topic no longer holds.
    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }

    /// How the last read found the live checkpoint, for `checkpoint show`.
    pub fn found(&self) -> Option<String> {
        let found = self.found.lock().expect("found lock").clone()?;
        Some(match found {
            Found::Indexed(offset) => format!(
                "Kafka topic {} offset {offset}, found through its index (consumer group {})",
                self.topic,
                self.index_group()
            ),
            Found::Scanned(offset) => format!(
                "Kafka topic {} offset {offset}, found by reading the topic back (no index yet: the next checkpoint written adds it)",
                self.topic
            ),
        })
    }
}

/// The consumer group whose offset is pipeline `name`'s index (its readers name it too: librdkafka's
/// `assign` needs a group).
pub(super) fn index_group(name: &str) -> String {
    format!("outboxd.{name}.reader")
}
