//! A transaction that holds the checkpoint topic's readers back, and when to call it hanging.
//!
//! A `read_committed` reader stops at the partition's last stable offset: the first record of the
//! oldest transaction still open. The leader's read of its checkpoint waits there rather than
//! resume from an older checkpoint (see `kafka::KafkaStore::scan`), which is right while the
//! transaction can still end: its writer commits it, or the brokers abort it once its
//! `transaction.timeout.ms` has passed (plus the coordinator's 10 s scan for timed-out ones).
//!
//! Some never end. Apache Kafka can lose track of an open transaction (a "hanging transaction",
//! KAFKA-12671 and its kin; our fault schedule met a stuck last stable offset after a single
//! broker's `kill -9`), and then every `read_committed` reader of the partition stops for good,
//! however often it retries. Only an operator can end it: `kafka-transactions.sh find-hanging`
//! lists the transactions their coordinator no longer knows (the proof that one is hanging), and
//! `abort` writes the marker. So once the readers have been held at one offset longer than any of
//! outboxd's own transactions may stay open, outboxd says so at ERROR (at most once a minute) with
//! those commands, and keeps retrying: the read goes on by itself the moment the marker is written.
//! Another client writing to the topic with a longer `transaction.timeout.ms` can look the same;
//! `find-hanging` tells them apart, and the message says so.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::Error;

/// How long after a transaction's timeout the brokers may take to abort it: their scan for
/// timed-out transactions runs every `transaction.abort.timed.out.transaction.cleanup.interval.ms`
/// (10 s by default), then the markers take a moment.
const ABORT_SCAN: Duration = Duration::from_secs(15);
/// How often the ERROR is repeated while the same transaction holds the readers.
const RETELL: Duration = Duration::from_secs(60);

/// Where the checkpoint topic's readers last stopped below the written end, and since when.
pub struct Held {
    state: Mutex<State>,
    /// Past this, the transaction is hanging: longer than any of outboxd's may stay open.
    hanging_after: Duration,
    /// The longest `transaction.timeout.ms` outboxd's writers of this topic use.
    longest: Duration,
}

#[derive(Default)]
struct State {
    /// The last stable offset readers stopped at, and since when.
    at: Option<(i64, Instant)>,
    /// When the ERROR was last logged.
    told: Option<Instant>,
}

impl Held {
    /// `longest`: the longest `transaction.timeout.ms` of outboxd's writers to the topic (the
    /// checkpoint writer's, and with exactly-once the record producer's).
    pub fn new(longest: Duration) -> Held {
        Held {
            state: Mutex::new(State::default()),
            hanging_after: longest + ABORT_SCAN,
            longest,
        }
    }

    /// Readers stopped at `stable` (the last stable offset) below the written end: how long they
    /// have been stopped there, across reads (a new offset starts the count again).
    pub fn observe(&self, stable: i64, now: Instant) -> Duration {
        let mut state = self.state.lock().expect("held lock");
        match state.at {
            Some((offset, since)) if offset == stable => now.saturating_duration_since(since),
            _ => {
                state.at = Some((stable, now));
                Duration::ZERO
            }
        }
    }

    /// A read got past everything written, or could not reach the brokers (their outage is no
    /// evidence about the transaction: the coordinator aborts a timed-out one soon after it is
    /// back): the count starts again.
    pub fn clear(&self) {
        self.state.lock().expect("held lock").at = None;
    }

    /// Held for longer than any of outboxd's transactions may stay open.
    pub fn hanging(&self, held_for: Duration) -> bool {
        held_for > self.hanging_after
    }

    /// Whether to log the ERROR now (at most once per [`RETELL`]).
    pub fn tell(&self, now: Instant) -> bool {
        let mut state = self.state.lock().expect("held lock");
        if state
            .told
            .is_some_and(|told| now.saturating_duration_since(told) < RETELL)
        {
            return false;
        }
        state.told = Some(now);
        true
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
            "a transaction open since offset {stable} of {topic} (partition 0, written up to {written}) has held back every committed-only reader for {}s, longer than outboxd's transactions may stay open ({}s and the brokers' abort): unless another client writes to {topic} with a longer transaction.timeout.ms, the brokers lost track of it (a hanging transaction), and no checkpoint written after it can be read until it ends",
            held_for.as_secs(),
            self.longest.as_secs()
        ))
        .remedy(format!(
            "`kafka-transactions.sh --bootstrap-server <kafka.brokers> find-hanging --topic {topic} --partition 0 --max-transaction-timeout 1` (with --command-config on a secured cluster) lists it when its coordinator has lost it (once its last write is a minute old: run it again after a minute if it lists nothing at first); then `kafka-transactions.sh --bootstrap-server <kafka.brokers> abort --topic {topic} --partition 0 --start-offset {stable}`, and with kafka.exactly_once abort likewise what `find-hanging --broker-id N --max-transaction-timeout 1` lists for the same producer id on each broker. Not listed: its coordinator still has it and will end it (a longer transaction.timeout.ms), or the brokers' log says why not. outboxd retries meanwhile and carries on by itself once it ends (docs/operations/troubleshooting.md#checkpoints-and-standbys)"
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
    fn the_error_is_told_at_most_once_a_minute() {
        let held = Held::new(Duration::from_secs(60));
        let start = Instant::now();
        assert!(held.tell(start));
        assert!(!held.tell(start + Duration::from_secs(59)));
        assert!(held.tell(start + Duration::from_secs(61)));
    }

    #[test]
    fn the_hanging_error_names_the_offset_and_both_commands() {
        let held = Held::new(Duration::from_secs(60));
        let text = held
            .hanging_error("outboxd.checkpoints", 103, 239, Duration::from_secs(300))
            .to_string();
        assert!(text.contains("offset 103 of outboxd.checkpoints"), "{text}");
        assert!(
            text.contains(
                "find-hanging --topic outboxd.checkpoints --partition 0 --max-transaction-timeout 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("abort --topic outboxd.checkpoints --partition 0 --start-offset 103"),
            "{text}"
        );
    }
}
