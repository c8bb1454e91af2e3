//! Sinks take routed records and resolve each record's ticket when the destination acknowledges it.
//! A sink never sees source positions: the ticket is all it carries back.

pub mod kafka;
