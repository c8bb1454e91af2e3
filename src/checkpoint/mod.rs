//! Checkpoints: which source position is safe to resume from, and its durable copy.
//!
//! [`Tracker`] decides *what* is safe: the highest transaction boundary such that every record at or
//! before it has been acknowledged by Kafka. [`Store`] makes it durable, in a file ([`file`]: an
//! atomic JSON file guarded by a lock), in a compacted Kafka topic ([`kafka`]: no disk needed, and
//! with [`lease`] several instances of a pipeline can run, one leading, the others standing by), or
//! as a key in the Redis the Redis sink writes to ([`redis`]: committed with the entries).
//! [`Checkpointer`] owns both for a session: it issues tickets, takes boundaries and acks, and its
//! `flush` is the only way a safe position becomes the durable one. The pipeline's writer task calls
//! it at most every `checkpoint.interval_ms` (group commit), and once more when the session ends.

mod checkpointer;
pub mod debezium;
mod file;
mod held;
mod kafka;
mod lease;
#[cfg(feature = "redis")]
mod redis;
#[cfg(not(feature = "redis"))]
#[path = "redis_unbuilt.rs"]
mod redis;
mod store;
mod tracker;

pub use checkpointer::Checkpointer;
pub(crate) use kafka::is_connection_property;
pub use kafka::{KafkaStore, QuietContext};
pub use lease::Lease;
pub use store::{Access, Checkpoint, Store};
pub use tracker::Tracker;
