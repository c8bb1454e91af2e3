//! The one owner of the two positions a session cares about.
//!
//! *Safe*: the newest transaction boundary with every record at or before it acknowledged (the
//! [`Tracker`] decides it from tickets and boundaries). *Durable*: the newest position written to the
//! [`Store`]. Only [`Checkpointer::flush`] turns one into the other (group commit: one write covers
//! every ack since the last), so the periodic writer and the session's final write cannot differ.
//! A source that confirms progress to its server (a Postgres slot's `confirmed_flush_lsn`) asks a
//! [`Durable`] handle for the durable position; it never sees anything newer than what is on disk.
//!
//! Exactly-once (`kafka.exactly_once`, or the checkpoint in Redis) has no separate write: the
//! checkpoint goes in the same transaction as the records it covers ([`Checkpointer::mark`]: a
//! Kafka record, or the Redis key's new value), and the session reports
//! the transaction's commit ([`Checkpointer::committed`]). `flush` is then never called: a position
//! whose records were acknowledged but not committed is not safe, since an abort takes them back.

use std::sync::{Arc, OnceLock};

use tokio::sync::watch;

use super::{Checkpoint, Store, Tracker};
use crate::error::{Error, Result};
use crate::sink::Ticket;
use crate::source::{Durable, Position, SourceIdentity};

pub struct Checkpointer {
    store: Arc<Store>,
    tracker: Tracker,
    /// The source this session's positions belong to (known once the source is open).
    identity: OnceLock<SourceIdentity>,
    durable: watch::Sender<Option<Position>>,
}

impl Checkpointer {
    /// A session's checkpointer; [`Checkpointer::load`] reads where it resumes.
    pub fn new(store: Arc<Store>) -> Arc<Checkpointer> {
        let (durable, _) = watch::channel(None);
        Arc::new(Checkpointer {
            store,
            tracker: Tracker::new(),
            identity: OnceLock::new(),
            durable,
        })
    }

    /// Loads the stored checkpoint (which is durable already). Exactly-once sessions call it only
    /// after their producer fenced every earlier one, so no commit of theirs can land after it.
    pub async fn load(&self) -> Result<Option<Checkpoint>> {
        // The store may be a Kafka topic: its reads block.
        let reading = self.store.clone();
        let stored = tokio::task::spawn_blocking(move || reading.resume())
            .await
            .map_err(|e| Error::checkpoint(format!("checkpoint read task died: {e}")))??;
        self.durable
            .send_replace(stored.as_ref().map(|c| c.position.clone()));
        if stored.is_some() {
            // A stored checkpoint wins for good: a later reset means "start at the end".
            self.store.forget_unwritten_first();
            return Ok(stored);
        }
        // Not durable, so `begin` writes it again.
        let first = self.store.unwritten_first();
        if let Some(first) = &first {
            tracing::info!(
                position = %first.position,
                "no checkpoint stored yet: resuming from this process's first start, whose checkpoint write failed (the source's end now would skip the rows committed since)"
            );
        }
        Ok(first)
    }

    /// A handle for the source: the durable position as it moves (the stored one is known to it).
    /// `lead`: true while this instance holds the pipeline's lead (see [`Durable::fenced_earlier`]).
    pub fn durable(&self, lead: Option<watch::Receiver<bool>>) -> Durable {
        Durable::new(self.durable.subscribe(), lead)
    }

    /// The source is open: its positions belong to `identity`. Without a stored checkpoint, `start`
    /// is written at once, so a restart before the first transaction does not move the start.
    pub async fn begin(&self, identity: SourceIdentity, start: &Position) -> Result<()> {
        let stored = self.durable.borrow().is_some();
        if !stored {
            let store = self.store.clone();
            let (identity, start) = (identity.clone(), start.clone());
            tokio::task::spawn_blocking(move || store.write_first(&identity, &start))
                .await
                .map_err(|e| Error::checkpoint(format!("checkpoint write task died: {e}")))??;
        }
        let _ = self.identity.set(identity);
        Ok(())
    }

    /// The next record's ticket (call in source order).
    pub fn issue(&self) -> Ticket {
        self.tracker.issue()
    }

    /// A transaction boundary: every ticket issued so far belongs at or before it.
    pub fn boundary(&self, position: Position) {
        self.tracker.boundary(position)
    }

    pub fn ack(&self, ticket: Ticket) {
        self.tracker.ack(ticket)
    }

    /// The acknowledgements in flight (for draining and the delivery watchdog).
    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    /// Exactly-once: the checkpoint for `position`, to commit in the transaction that holds
    /// every record before it.
    pub fn mark(&self, position: &Position) -> Result<crate::sink::CommitMark> {
        let Some(identity) = self.identity.get() else {
            return Err(Error::checkpoint(
                "a transaction was committed before the source was open (a bug)",
            ));
        };
        self.store.live_mark(identity, position)
    }

    /// Whether `position` is what this process stored last (a transaction holding only its
    /// checkpoint would change nothing).
    pub fn is_durable(&self, position: &Position) -> bool {
        self.identity
            .get()
            .is_some_and(|identity| self.store.unchanged(identity, position))
    }

    /// Exactly-once: the transaction holding the checkpoint `position` committed; it is durable.
    pub fn committed(&self, position: Position) {
        if let Some(identity) = self.identity.get() {
            self.store.mark_written(identity, &position);
        }
        self.durable.send_replace(Some(position));
    }

    /// Writes the newest safe position, if there is one newer than the last write, and makes it
    /// the durable one. Returns what it wrote.
    pub async fn flush(&self) -> Result<Option<Position>> {
        let Some(identity) = self.identity.get() else {
            return Ok(None);
        };
        let Some(position) = self.tracker.take_safe() else {
            return Ok(None);
        };
        crate::fault::crash_point(crate::fault::AFTER_ACK_BEFORE_CHECKPOINT);
        let store = self.store.clone();
        let identity = identity.clone();
        let written = position.clone();
        tokio::task::spawn_blocking(move || store.advance(&identity, &written))
            .await
            .map_err(|e| Error::checkpoint(format!("checkpoint write task died: {e}")))??;
        // Only now may the source confirm it to the server (Postgres: the slot).
        self.durable.send_replace(Some(position.clone()));
        Ok(Some(position))
    }
}
