//! outboxd: the transactional outbox without polling.
//!
//! The database's own log is tailed ([`source`]), INSERTs into outbox tables are turned into
//! records ([`route`]), published to one broker (Kafka, RabbitMQ, NATS JetStream, Redis Streams,
//! SQS or SNS) that acknowledges each ([`sink`]), and the log position is checkpointed only once
//! everything before it is acknowledged ([`checkpoint`]). [`pipeline`] wires the stages and owns
//! back-pressure, reconnects and shutdown. [`reference`] makes the docs' reference pages from the
//! code.

pub mod audit;
pub mod check;
pub mod checkpoint;
pub mod config;
pub mod dry_run;
pub mod error;
pub mod fault;
pub mod http;
pub mod metrics;
pub mod pipeline;
pub mod preflight;
pub mod reference;
pub mod retention;
pub mod route;
pub mod runtime;
pub mod schema;
pub mod secrets;
pub mod sink;
pub mod source;

pub use error::{Error, Kind, Result};
