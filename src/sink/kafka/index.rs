//! Where a pipeline's live checkpoint record sits on the checkpoint topic, committed in the same
//! Kafka transaction as the record itself.
//!
//! Why: pipelines share the checkpoint topic's one partition, and compaction runs rarely (hourly at
//! best, never past an open transaction), so a quiet pipeline's checkpoint may lie millions of
//! records before the end; reading it back meant reading all of them. And a topic that lost its data
//! (one replica on a failed disk) came back empty, which reads exactly like a first start.
//!
//! How: every transaction that writes the live record also commits the record's offset as the
//! offset of consumer group `outboxd.<name>.reader` on that partition (KIP-98's
//! `send_offsets_to_transaction`, the way Kafka Streams commits its input positions), with a
//! metadata string saying whether the record is a checkpoint or a tombstone. Kafka makes the offset
//! visible exactly when the transaction commits, so the index never points at an aborted record,
//! and a reader asking for stable offsets waits only for this pipeline's own open transaction. The
//! offset lives in `__consumer_offsets`, replicated apart from the checkpoint topic: when the topic
//! no longer holds the record the index names, the checkpoint was lost, not never written.
//!
//! Kafka expires the offsets of a group without members `offsets.retention.minutes` (7 days) after
//! their last commit, so the index lasts a week after the last checkpoint written. Without an
//! index (expired, or never written) the reader falls back to reading the topic, and the next
//! write adds it. Nothing commits an entry again by itself (a renewal, a refresh after a read): it
//! would have to be the newest, yet the exactly-once sink's producer may commit a newer one at any
//! moment, and the lease's heartbeat must not wait on the group's coordinator.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::producer::{Producer, ProducerContext};
use rdkafka::{Offset, TopicPartitionList};

/// The metadata of an entry pointing at a checkpoint record.
const LIVE: &str = "outboxd:checkpoint";
/// The metadata of an entry pointing at a tombstone (`checkpoint reset`): once compaction removed
/// it, its absence is no loss.
const REMOVED: &str = "outboxd:tombstone";

/// One entry of the index: the live record's offset on partition 0, and what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Indexed {
    pub offset: i64,
    /// The record is a tombstone.
    pub removed: bool,
}

impl Indexed {
    /// The entry as the offsets a transaction commits for the group.
    pub fn partition_list(&self, topic: &str) -> KafkaResult<TopicPartitionList> {
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(topic, 0, Offset::Offset(self.offset))?;
        if let Some(mut element) = list.find_partition(topic, 0) {
            element.set_metadata(if self.removed { REMOVED } else { LIVE });
        }
        Ok(list)
    }

    /// The entry in what the group's coordinator answered; `None` when the group has no offset
    /// there, or one outboxd did not write (its metadata is not ours).
    pub fn from_committed(list: &TopicPartitionList, topic: &str) -> Option<Indexed> {
        let element = list.find_partition(topic, 0)?;
        let Offset::Offset(offset) = element.offset() else {
            return None;
        };
        let removed = match element.metadata() {
            LIVE => false,
            REMOVED => true,
            _ => return None,
        };
        Some(Indexed { offset, removed })
    }
}

/// What a transaction needs to index the checkpoint record it carries (shared by the checkpoint
/// store's writer and an exactly-once sink's transactions).
#[derive(Clone)]
pub struct RecordIndex {
    topic: String,
    /// The group's name (for messages) and metadata (for the transaction).
    name: String,
    group: Arc<ConsumerGroupMetadata>,
}

impl RecordIndex {
    pub fn new(topic: &str, name: &str, group: ConsumerGroupMetadata) -> RecordIndex {
        RecordIndex {
            topic: topic.to_string(),
            name: name.to_string(),
            group: Arc::new(group),
        }
    }

    /// The group's name.
    pub fn group(&self) -> &str {
        &self.name
    }

    /// Adds `entry` to `producer`'s open transaction, waiting at most `timeout` plus [`GRACE`].
    ///
    /// librdkafka's `send_offsets_to_transaction` can wait far past its timeout: while the group
    /// coordinator it cached is gone (a broker stopped, as in a rolling restart) it waits for that
    /// broker's state to change (confluentinc/librdkafka#5456 and #5511, open in 2.12). Seen here:
    /// a checkpoint write held the lead, the checkpoint and a SIGTERM for 10 minutes. So the call
    /// runs on a thread of its own. When it overstays, [`SendError::Stuck`] says so, and the
    /// producer must not be used again (its transactional API is still busy): the caller drops its
    /// handle, the thread keeps the producer until the call returns, and the next writer's
    /// `init_transactions` fences it.
    pub fn send<C, P>(
        &self,
        producer: &Arc<P>,
        entry: Indexed,
        timeout: Duration,
    ) -> Result<(), SendError>
    where
        C: ProducerContext + 'static,
        P: Producer<C> + Send + Sync + 'static,
    {
        let offsets = entry.partition_list(&self.topic)?;
        let (producer, group) = (producer.clone(), self.group.clone());
        let (done, result) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("outboxd-index".into())
            .spawn(move || {
                // Holds the call the way librdkafka does when its coordinator is gone (test
                // `a_checkpoint_write_stuck_in_librdkafka_is_given_up_and_written_again`).
                crate::fault_point!("index_send_hangs");
                crate::fault::hang_once_released(crate::fault::INDEX_SEND_HANGS_WHEN_RELEASED);
                let _ = done.send(producer.send_offsets_to_transaction(&offsets, &group, timeout));
            })
            // Not called: the producer is not busy, and the write fails as any other would.
            .map_err(|_| SendError::Kafka(KafkaError::Canceled))?;
        let waited = timeout + GRACE;
        match result.recv_timeout(waited) {
            Ok(sent) => sent.map_err(SendError::Kafka),
            // The thread ended without an answer (it panicked): the call is not running either.
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                Err(SendError::Kafka(KafkaError::Canceled))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let given_up = GIVEN_UP.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                Err(SendError::Stuck(format!(
                    "librdkafka's send_offsets_to_transaction for group {} did not return within {waited:?} (it waits for a group coordinator it lost: confluentinc/librdkafka#5456); this producer is given up ({given_up} so far in this process, each kept with its thread until librdkafka returns)",
                    self.name
                )))
            }
        }
    }
}

/// How long past its own timeout [`RecordIndex::send`] waits for librdkafka's call: librdkafka
/// checks its timeouts about once a second, and on a loaded machine a call that merely timed out
/// must not be taken for a stuck one (that costs the writer).
pub const GRACE: Duration = Duration::from_secs(5);

/// Producers given up as stuck in this process (each lingers until librdkafka returns).
static GIVEN_UP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Why [`RecordIndex::send`] failed.
#[derive(Debug)]
pub enum SendError {
    /// librdkafka's answer: the transaction's state says whether to retry, abort or stop.
    Kafka(KafkaError),
    /// The call did not return in time (what happened, for the log): the producer is unusable.
    Stuck(String),
}

impl From<KafkaError> for SendError {
    fn from(e: KafkaError) -> SendError {
        SendError::Kafka(e)
    }
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Kafka(e) => e.fmt(f),
            SendError::Stuck(what) => f.write_str(what),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_survives_its_trip_through_a_partition_list_and_foreign_metadata_is_no_entry() {
        for entry in [
            Indexed {
                offset: 41,
                removed: false,
            },
            Indexed {
                offset: 0,
                removed: true,
            },
        ] {
            let list = entry.partition_list("cp").unwrap();
            assert_eq!(Indexed::from_committed(&list, "cp"), Some(entry));
            assert_eq!(Indexed::from_committed(&list, "other"), None);
        }
        let mut foreign = TopicPartitionList::new();
        foreign
            .add_partition_offset("cp", 0, Offset::Offset(7))
            .unwrap();
        assert_eq!(Indexed::from_committed(&foreign, "cp"), None);
        let mut none = TopicPartitionList::new();
        none.add_partition_offset("cp", 0, Offset::Invalid).unwrap();
        assert_eq!(Indexed::from_committed(&none, "cp"), None);
    }
}
