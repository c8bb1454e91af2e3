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

use super::{group_lookup_error, unreachable, Isolation, KafkaStore, TIMEOUT};
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
        format!("outboxd.{}.reader", self.name)
    }

    /// The newest committed value of the live key: through the index when there is one, else by
    /// reading the topic back (and the index learns where it is, for the next renewal).
    pub(super) fn latest_live(&self) -> Result<Option<Vec<u8>>> {
        if self.missing {
            return Ok(None);
        }
        if let Some(entry) = self.read_index()? {
            return self.at_index(entry);
        }
        let key = self.live_key();
        match self.newest(Isolation::Committed, &key)? {
            Some((offset, value)) => {
                *self.found.lock().expect("found lock") = Some(Found::Scanned(offset));
                Ok(value)
            }
            None => Ok(None),
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
                Err(e) => return Err(unreachable(&self.topic, &e)),
            }
        }
    }

    /// The live value at the index's entry, or the loss it reveals.
    fn at_index(&self, entry: Indexed) -> Result<Option<Vec<u8>>> {
        let (low, high) = self.watermarks()?;
        let key = self.live_key();
        let mut there: Option<(i64, bool, Option<Vec<u8>>)> = None;
        if (low..high).contains(&entry.offset) {
            self.scan(
                Isolation::Written,
                entry.offset,
                entry.offset + 1,
                |offset, k, v| {
                    if there.is_none() {
                        there = Some((offset, k == key.as_bytes(), v.map(<[u8]>::to_vec)));
                    }
                },
            )?;
        }
        match there {
            Some((offset, true, value)) if offset == entry.offset => {
                *self.found.lock().expect("found lock") = Some(Found::Indexed(offset));
                Ok(value)
            }
            // A tombstone (`checkpoint reset`) that compaction removed: no checkpoint.
            _ if entry.removed => Ok(None),
            _ => {
                self.lost.store(true, Ordering::Relaxed);
                let now = match there {
                    Some((offset, _, _)) if offset == entry.offset => {
                        "another record there".to_string()
                    }
                    _ if high <= low => "no records at all".to_string(),
                    _ => format!("offsets {low} to {} only", high - 1),
                };
                Err(Error::checkpoint(format!(
                    "the checkpoint topic {} lost pipeline {:?}'s checkpoint: its index (consumer group {}) says it was written at offset {}, and the topic holds {now} (the topic was recreated, or a broker lost its data)",
                    self.topic, self.name, self.index_group(), entry.offset
                ))
                .remedy(
                    "outboxd does not start over by itself (that would skip every change since the lost checkpoint with the MySQL source). Put a checkpoint back with `outboxd checkpoint set POSITION` (a saved label's position from `outboxd checkpoint list`, or the source position of the last event the consumers have), or start anew on purpose with `outboxd checkpoint reset`; then keep the topic on 3 replicas (see `outboxd check`)",
                ))
            }
        }
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
                "Kafka topic {} offset {offset}, found by reading the topic back (no index yet: the next checkpoint or renewal written adds it)",
                self.topic
            ),
        })
    }
}
