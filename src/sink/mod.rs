//! Sinks deliver routed records and report, per record, that the destination acknowledged it.
//!
//! The pipeline hands a sink each record with a [`Ticket`] (the record's place in source order) and
//! an [`Acks`] receiver; the sink hands the ticket back through [`Acks::acked`] when the destination
//! has the record, or reports [`Acks::failed`]. A sink never sees source positions: the ticket is
//! all it carries, so turning acks into a checkpoint stays the checkpoint's job. A second sink is one
//! more module here that speaks these two types.

pub mod kafka;

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
