//! Exactly-once: when the session commits its sink's transaction.
//!
//! With `kafka.exactly_once` (or the checkpoint in Redis: one `MULTI`/`EXEC` where this says
//! "Kafka transaction"), one Kafka transaction holds the records of whole source transactions
//! and, last, the checkpoint record of their end, so a `read_committed` consumer sees the records
//! exactly when the position that follows them is stored, and a crash anywhere before the commit
//! takes back both: the next session resumes from the committed checkpoint and sends them again
//! into a new transaction. This module only decides *when* to commit; the session does it.
//!
//! A commit happens at a source transaction boundary, never inside a source transaction (a commit
//! there would make half of it visible and leave the checkpoint before it). It happens at the first
//! boundary once the open Kafka transaction holds `transaction_max_records` records or
//! `transaction_max_bytes` bytes, or has been open `transaction_interval_ms`; when the source is
//! quiet, a timer commits at that interval ([`Batch::due`]). Boundaries without records (other
//! tables, heartbeats) move the checkpoint too, through a transaction holding the checkpoint alone,
//! at most once per interval.
//!
//! Why it stretches under a backlog: a commit waits for the transaction's acks and a round trip to
//! the transaction coordinator, and nothing is sent meanwhile (one producer holds one transaction at
//! a time). Measured on noida-db, committing every 100 ms drained a backlog at 0.4x the speed of
//! at-least-once, every second at 0.8x (`BENCHMARKS.md`). So when the source is behind and more
//! changes are already waiting at a boundary past the interval (visibility is late anyway), the
//! transaction grows until a size limit or [`STRETCH`] times the interval; a source that is caught
//! up still commits at the interval.

use std::time::{Duration, Instant};

use crate::sink::delivery::TransactionLimits;
use crate::source::Position;

/// Under a backlog, a transaction may stay open this many intervals (see the module doc).
pub(super) const STRETCH: u32 = 30;

/// What the open Kafka transaction holds, and the boundary a commit would store.
pub(super) struct Batch {
    interval: Duration,
    /// How long a transaction may stay open under a backlog: [`STRETCH`] intervals, but at most
    /// a quarter of the brokers' transaction timeout, if they have one (the commit's flush of the
    /// window must fit in what is left).
    stretched: Duration,
    /// The last boundary with a commit time was behind (the source is catching up).
    lagging: bool,
    max_records: u64,
    max_bytes: u64,
    /// When the first change since the last commit arrived.
    since: Option<Instant>,
    records: u64,
    bytes: u64,
    /// Records were sent since the last commit: a Kafka transaction is open.
    open: bool,
    /// When the newest Kafka transaction began (kept after its commit, for explaining a failure).
    began: Option<Instant>,
    /// Records of a source transaction whose boundary has not arrived yet were sent.
    partial: bool,
    /// The newest boundary since the last commit.
    end: Option<Position>,
}

/// What a commit stores and whether a Kafka transaction is open already.
pub(super) struct Commit {
    pub end: Position,
    pub open: bool,
}

impl Batch {
    pub fn new(limits: &TransactionLimits) -> Batch {
        let interval = limits.interval;
        let stretched = limits
            .broker_timeout
            .map_or(interval * STRETCH, |t| (interval * STRETCH).min(t / 4))
            .max(interval);
        Batch {
            interval,
            stretched,
            lagging: false,
            max_records: limits.max_records,
            max_bytes: limits.max_bytes,
            since: None,
            records: 0,
            bytes: 0,
            open: false,
            began: None,
            partial: false,
            end: None,
        }
    }

    /// A record of `bytes` is about to be sent; `true` when a Kafka transaction must begin first.
    pub fn record(&mut self, bytes: usize, now: Instant) -> bool {
        self.since.get_or_insert(now);
        self.records += 1;
        self.bytes += bytes as u64;
        self.partial = true;
        let begins = !std::mem::replace(&mut self.open, true);
        if begins {
            self.began = Some(now);
        }
        begins
    }

    /// When the newest Kafka transaction began.
    pub fn began(&self) -> Option<Instant> {
        self.began
    }

    /// A transaction holding only the checkpoint begins (its age counts like any other's).
    pub fn begin_checkpoint_only(&mut self, now: Instant) {
        self.began = Some(now);
    }

    /// A source transaction boundary; `true` when the session should commit now. `lagging`: its
    /// transaction committed a while ago (`None`: the boundary has no commit time, a heartbeat,
    /// and the last judgement stands); `queued`: more changes are already waiting.
    pub fn boundary(
        &mut self,
        position: Position,
        now: Instant,
        lagging: Option<bool>,
        queued: bool,
    ) -> bool {
        let since = *self.since.get_or_insert(now);
        self.partial = false;
        self.end = Some(position);
        if let Some(lagging) = lagging {
            self.lagging = lagging;
        }
        let limit = if self.lagging && queued {
            self.stretched
        } else {
            self.interval
        };
        self.records >= self.max_records || self.bytes >= self.max_bytes || now >= since + limit
    }

    /// When a quiet source's pending boundary should be committed (a source with nothing waiting
    /// is caught up: the plain interval applies); `None` while a source
    /// transaction is half sent or nothing waits.
    pub fn due(&self) -> Option<Instant> {
        if self.partial || self.end.is_none() {
            return None;
        }
        // Catching up, an empty queue is a moment's gap in the reader, not a quiet source.
        let wait = if self.lagging {
            self.stretched
        } else {
            self.interval
        };
        self.since.map(|since| since + wait)
    }

    /// Whether records after the last boundary were sent (a commit now is impossible).
    pub fn partial(&self) -> bool {
        self.partial
    }

    /// Whether a Kafka transaction is open.
    pub fn open(&self) -> bool {
        self.open
    }

    /// Takes what the next commit stores, and starts counting anew. `None` when no boundary
    /// arrived since the last commit. Never while `partial`.
    pub fn take(&mut self) -> Option<Commit> {
        debug_assert!(!self.partial, "a commit inside a source transaction");
        let end = self.end.take()?;
        let commit = Commit {
            end,
            open: self.open,
        };
        self.since = None;
        self.records = 0;
        self.bytes = 0;
        self.open = false;
        Some(commit)
    }

    /// A commit failed: the transaction may still be open (the session ends and aborts it).
    pub fn failed(&mut self) {
        self.open = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::postgres::Lsn;

    fn batch(interval_ms: u64, max_records: u64, max_bytes: u64) -> Batch {
        Batch::new(&TransactionLimits {
            interval: Duration::from_millis(interval_ms),
            max_records,
            max_bytes,
            broker_timeout: Some(Duration::from_secs(60)),
            commit_timeout: Duration::from_secs(60),
        })
    }

    fn at(n: u64) -> Position {
        Position::Lsn(Lsn(n))
    }

    #[test]
    fn commits_only_at_boundaries_once_a_limit_is_reached() {
        let t0 = Instant::now();
        let mut b = batch(100, 3, 1 << 20);
        assert!(b.record(10, t0), "the first record begins a transaction");
        assert!(!b.record(10, t0), "later ones join it");
        assert_eq!(b.due(), None, "half a source transaction is never due");
        assert!(!b.boundary(at(1), t0, Some(false), true), "2 records < 3");
        assert_eq!(b.due(), Some(t0 + Duration::from_millis(100)));
        b.record(10, t0);
        assert!(b.partial());
        assert!(
            b.boundary(at(2), t0, Some(true), true),
            "3 records, backlog or not"
        );
        let commit = b.take().unwrap();
        assert_eq!(commit.end, at(2));
        assert!(commit.open);
        assert!(b.take().is_none(), "nothing since");
        assert!(b.record(10, t0), "a new transaction begins after a commit");
    }

    #[test]
    fn bytes_and_age_commit_too() {
        let t0 = Instant::now();
        let mut b = batch(100, 1000, 1024);
        b.record(1000, t0);
        b.record(100, t0);
        assert!(
            b.boundary(at(1), t0, Some(true), true),
            "1100 bytes >= 1024"
        );
        b.take();
        b.record(1, t0);
        assert!(!b.boundary(at(2), t0 + Duration::from_millis(99), Some(false), true));
        assert!(b.boundary(at(3), t0 + Duration::from_millis(100), Some(false), true));
        b.take();
        b.record(1, t0);
        assert!(
            !b.boundary(at(4), t0 + Duration::from_millis(2999), Some(true), true),
            "a backlog stretches the transaction"
        );
        assert!(
            b.boundary(at(5), t0 + Duration::from_millis(3000), None, true),
            "up to 30 intervals"
        );
    }

    #[test]
    fn a_lagging_source_is_not_taken_for_a_quiet_one_by_the_timer() {
        let t0 = Instant::now();
        let mut b = batch(100, 1000, 1 << 20);
        b.record(1, t0);
        assert!(!b.boundary(at(1), t0, Some(true), false));
        assert_eq!(b.due(), Some(t0 + Duration::from_millis(3000)));
        assert!(
            !b.boundary(at(2), t0, None, false),
            "a heartbeat keeps the judgement"
        );
        assert_eq!(b.due(), Some(t0 + Duration::from_millis(3000)));
        assert!(!b.boundary(at(3), t0, Some(false), false));
        assert_eq!(b.due(), Some(t0 + Duration::from_millis(100)), "caught up");
    }

    #[test]
    fn idle_boundaries_make_a_checkpoint_only_commit_after_the_interval() {
        let t0 = Instant::now();
        let mut b = batch(50, 1000, 1 << 20);
        assert!(!b.boundary(at(1), t0, None, false));
        assert!(!b.boundary(at(2), t0 + Duration::from_millis(10), None, false));
        assert_eq!(b.due(), Some(t0 + Duration::from_millis(50)));
        let commit = b.take().unwrap();
        assert_eq!(commit.end, at(2));
        assert!(
            !commit.open,
            "no records: the checkpoint needs a transaction of its own"
        );
        assert!(b.take().is_none() && !b.open() && b.due().is_none());
        b.failed();
        assert!(b.open(), "a failed commit leaves a transaction to abort");
    }
}
