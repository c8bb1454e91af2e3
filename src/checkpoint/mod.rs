//! Checkpoints: which source position is safe to resume from, and its durable copy on disk.
//!
//! [`Tracker`] decides *what* is safe: the highest transaction boundary such that every record at or
//! before it has been acknowledged by Kafka. [`Store`] makes it durable: an atomic JSON file (temp file,
//! fsync, rename, fsync of the directory) guarded by a lock file so two `run`s never share one.
//! [`Checkpointer`] owns both for a session: it issues tickets, takes boundaries and acks, and its
//! `flush` is the only way a safe position becomes the durable one. The pipeline's writer task calls
//! it at most every `checkpoint.interval_ms` (group commit), and once more when the session ends.

mod checkpointer;
pub mod debezium;
mod store;
mod tracker;

pub use checkpointer::Checkpointer;
pub use store::{Checkpoint, Store};
pub use tracker::Tracker;
