//! Checkpoints: which source position is safe to resume from, and its durable copy on disk.
//!
//! [`Tracker`] decides *what* is safe: the highest transaction boundary such that every record at or
//! before it has been acknowledged by Kafka. [`Store`] makes it durable: an atomic JSON file (temp file,
//! fsync, rename, fsync of the directory) guarded by a lock file so two `run`s never share one.
//! The pipeline's writer task asks the tracker for a new safe position at most every
//! `checkpoint.interval_ms` and writes once for all acks since the last write (group commit).

mod store;
mod tracker;

pub use store::{Checkpoint, Store};
pub use tracker::{Ticket, Tracker};
