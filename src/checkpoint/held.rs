//! A transaction that holds the checkpoint topic's readers back, and when to call it hanging.
//!
//! A `read_committed` reader stops at the partition's last stable offset: the first record of the
//! oldest transaction still open. The leader's read of its checkpoint waits there rather than
//! resume from an older checkpoint (see `kafka::KafkaStore::scan`), which is right while the
//! transaction can still end: its writer commits it, or the brokers abort it once its
//! `transaction.timeout.ms` has passed (plus the coordinator's 10 s scan for timed-out ones).
//!
//! Some never end. Apache Kafka can lose track of an open transaction (a "hanging transaction":
//! KAFKA-12671, and seen by our fault schedule after a single broker's `kill -9`), and then every
//! `read_committed` reader of the partition stops for good, no matter how often it retries. Only
//! an operator can end it (`kafka-transactions.sh abort`, which writes the abort marker), so once
//! the readers have been held longer than any of outboxd's own transactions may stay open, outboxd
//! says so at ERROR with the two commands that find and abort it, and keeps retrying: the read
//! goes on by itself the moment the marker is written.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::Error;

/// How long after a transaction's timeout the brokers may take to abort it: their scan for
/// timed-out transactions runs every `transaction.abort.timed.out.transaction.cleanup.interval.ms`
/// (10 s by default), then the markers take a moment.
const ABORT_SCAN: Duration = Duration::from_secs(15);

/// Where the checkpoint topic's readers last stopped below the written end, and since when.
pub struct Held {
    at: Mutex<Option<(i64, Instant)>>,
    /// Past this, the transaction is hanging: longer than any of outboxd's may stay open.
    hanging_after: Duration,
    /// The longest `transaction.timeout.ms` outboxd's writers of this topic use.
    longest: Duration,
}

impl Held {
    /// `longest`: the longest `transaction.timeout.ms` of outboxd's writers to the topic (the
    /// checkpoint writer's, and with exactly-once the record producer's).
    pub fn new(longest: Duration) -> Held {
        Held {
            at: Mutex::new(None),
            hanging_after: longest + ABORT_SCAN,
            longest,
        }
    }

    /// Readers stopped at `stable` (the last stable offset) below the written end: how long they
    /// have been stopped there, across reads (a new offset starts the count again).
    pub fn observe(&self, stable: i64, now: Instant) -> Duration {
        let mut at = self.at.lock().expect("held lock");
        match *at {
            Some((offset, since)) if offset == stable => now.saturating_duration_since(since),
            _ => {
                *at = Some((stable, now));
                Duration::ZERO
            }
        }
    }

    /// A read got past everything written: nothing holds the readers back.
    pub fn clear(&self) {
        *self.at.lock().expect("held lock") = None;
    }

    /// Held for longer than any of outboxd's transactions may stay open.
    pub fn hanging(&self, held_for: Duration) -> bool {
        held_for > self.hanging_after
    }

    /// What is wrong and the commands that end it, for a transaction open at `stable` held `for`.
    pub fn hanging_error(
        &self,
        topic: &str,
        stable: i64,
        written: i64,
        held_for: Duration,
    ) -> Error {
        Error::checkpoint(format!(
            "a transaction open since offset {stable} of {topic} (partition 0, written up to {written}) has held back every committed-only reader for {}s, longer than outboxd's transactions may stay open ({}s and the brokers' abort): the brokers lost track of it (a hanging transaction), and no checkpoint written after it can be read until it ends",
            held_for.as_secs(),
            self.longest.as_secs()
        ))
        .remedy(format!(
            "if another client writes to {topic} with a longer transaction.timeout.ms, wait for it; otherwise abort it: `kafka-transactions.sh --bootstrap-server <kafka.brokers> find-hanging --broker-id <leader of {topic}-0> --max-transaction-timeout {minutes}` should list it, then `kafka-transactions.sh --bootstrap-server <kafka.brokers> abort --topic {topic} --partition 0 --start-offset {stable}` (with kafka.exactly_once, abort the event-topic partitions it lists for the same producer the same way); outboxd retries meanwhile and carries on by itself once it is aborted (README \"Troubleshooting\")",
            minutes = self.longest.as_secs().div_ceil(60).max(1)
        ))
        .transient()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_stable_offset_counts_up_and_a_new_one_starts_again() {
        let held = Held::new(Duration::from_secs(60));
        let start = Instant::now();
        assert_eq!(held.observe(103, start), Duration::ZERO);
        let later = start + Duration::from_secs(74);
        assert_eq!(held.observe(103, later), Duration::from_secs(74));
        assert!(!held.hanging(Duration::from_secs(74)));
        assert!(held.hanging(Duration::from_secs(76)));
        assert_eq!(held.observe(140, later), Duration::ZERO);
        held.clear();
        assert_eq!(
            held.observe(140, later + Duration::from_secs(9)),
            Duration::ZERO
        );
    }

    #[test]
    fn the_hanging_error_names_the_offset_and_both_commands() {
        let held = Held::new(Duration::from_secs(60));
        let text = held
            .hanging_error("outboxd.checkpoints", 103, 239, Duration::from_secs(300))
            .to_string();
        assert!(text.contains("offset 103 of outboxd.checkpoints"), "{text}");
        assert!(text.contains("find-hanging"), "{text}");
        assert!(
            text.contains("abort --topic outboxd.checkpoints --partition 0 --start-offset 103"),
            "{text}"
        );
    }
}
