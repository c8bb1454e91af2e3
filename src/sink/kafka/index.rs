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
use rdkafka::error::KafkaResult;
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

    /// Adds `entry` to `producer`'s open transaction.
    pub fn send<C: ProducerContext, P: Producer<C>>(
        &self,
        producer: &P,
        entry: Indexed,
        timeout: Duration,
    ) -> KafkaResult<()> {
        let offsets = entry.partition_list(&self.topic)?;
        producer.send_offsets_to_transaction(&offsets, &self.group, timeout)
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
