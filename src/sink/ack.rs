//! The seam between a sink and the checkpoint: a [`Ticket`] travels with each record, and the sink
//! hands it back through [`Acks`]. A leaf, so every sink depends on it and on nothing above it.

use crate::error::Error;

/// A record's place in source order: issued by the checkpoint's tracker, returned by the sink.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticket(pub(crate) u64);

/// Where a sink reports what became of the records it was given. Called from the sink's own
/// threads (librdkafka's delivery callback), so implementations must be quick and must not block.
pub trait Acks: Send + Sync + 'static {
    /// The destination acknowledged the record holding `ticket`.
    fn acked(&self, ticket: Ticket);
    /// A record could not be delivered: the session must end (`error` says whether a reconnect
    /// can cure it).
    fn failed(&self, error: Error);
}
