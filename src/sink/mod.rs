//! Sinks deliver routed records and report, per record, that the destination acknowledged it.
//!
//! The pipeline hands a sink each record with a [`Ticket`] (the record's place in source order) and
//! an [`Acks`] receiver; the sink hands the ticket back through [`Acks::acked`] when the destination
//! has the record, or reports [`Acks::failed`]. A sink never sees source positions: the ticket is
//! all it carries, so turning acks into a checkpoint stays the checkpoint's job.
//!
//! [`Sink`] is the one type the pipeline holds: one arm per broker, each a module of its own with
//! its config section (`config.rs`), its client and its `check` lines. Adding a sink is a module
//! and an arm here (and in [`SinkConfig`]); the pipeline does not change. Kafka's transactions
//! (exactly-once) exist on the Kafka arm only; the config refuses `exactly_once` anywhere else.

pub mod ack;
pub mod delivery;
pub mod kafka;
pub mod rabbitmq;

use std::sync::Arc;
use std::time::Duration;

pub use ack::{Acks, Ticket};
pub use delivery::Delivery;

use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::route::Record;
use kafka::config::KafkaConfig;
use kafka::{KafkaSink, TopicState};
use rabbitmq::config::RabbitMqConfig;
use rabbitmq::RabbitMqSink;

/// The pipeline's sink section (exactly one per config).
#[derive(Debug, Clone, Copy)]
pub enum SinkConfig<'a> {
    Kafka(&'a KafkaConfig),
    RabbitMq(&'a RabbitMqConfig),
}

impl SinkConfig<'_> {
    /// The section's name (`kafka`, `rabbitmq`).
    pub fn name(&self) -> &'static str {
        match self {
            SinkConfig::Kafka(_) => "kafka",
            SinkConfig::RabbitMq(_) => "rabbitmq",
        }
    }

    /// The router for this sink: records larger than the sink sends (or, on RabbitMQ, with more
    /// key and header bytes than a properties frame carries) are unroutable as `too_large`.
    pub fn router(&self, route: &crate::route::RouteConfig) -> crate::route::Router {
        use crate::route::Router;
        match self {
            SinkConfig::Kafka(kafka) => {
                Router::new(route.clone(), KafkaSink::max_message_bytes(kafka))
            }
            SinkConfig::RabbitMq(rabbitmq) => {
                Router::new(route.clone(), rabbitmq.max_message_bytes)
                    .with_max_header_bytes(rabbitmq::MAX_HEADER_BYTES)
            }
        }
    }
}

/// One session's connection to the destination.
pub enum Sink {
    Kafka(KafkaSink),
    /// Boxed: the AMQP connection and channel handles are large, and the session holds one sink.
    RabbitMq(Box<RabbitMqSink>),
}

/// Room in the sink's window for one record ([`Sink::reserve`]).
pub enum Room {
    Kafka(kafka::Room),
    RabbitMq(rabbitmq::Room),
}

impl Sink {
    /// The session's sink; `transactional_id` makes the Kafka producer transactional.
    pub async fn open(
        name: &str,
        config: SinkConfig<'_>,
        transactional_id: Option<&str>,
        acks: Arc<dyn Acks>,
        metrics: Arc<Metrics>,
    ) -> Result<Sink> {
        Ok(match config {
            SinkConfig::Kafka(kafka) => Sink::Kafka(KafkaSink::new(
                name,
                kafka,
                transactional_id,
                acks,
                metrics,
            )?),
            SinkConfig::RabbitMq(rabbitmq) => Sink::RabbitMq(Box::new(
                RabbitMqSink::new(name, rabbitmq, acks, metrics).await?,
            )),
        })
    }

    /// Waits for room in the window for `record`. Cancel-safe.
    pub async fn reserve(&self, record: &Record) -> Result<Room> {
        Ok(match self {
            Sink::Kafka(sink) => Room::Kafka(sink.reserve(record).await?),
            Sink::RabbitMq(sink) => Room::RabbitMq(sink.reserve(record).await?),
        })
    }

    /// Sends `record` in `room`; its acknowledgement hands `ticket` to the session's [`Acks`].
    pub async fn send(&self, room: Room, record: &Record, ticket: Ticket) -> Result<()> {
        match (self, room) {
            (Sink::Kafka(sink), Room::Kafka(room)) => sink.send(room, record, ticket).await,
            (Sink::RabbitMq(sink), Room::RabbitMq(room)) => sink.send(room, record, ticket).await,
            _ => Err(Error::sink("room from another sink (a bug)")),
        }
    }

    /// Whether `topic` can take records. Only Kafka can say before sending; RabbitMQ answers per
    /// message (a return), which its sink handles.
    pub async fn topic_state(&self, topic: &str) -> Result<TopicState> {
        match self {
            Sink::Kafka(sink) => sink.topic_state(topic).await,
            Sink::RabbitMq(_) => Ok(TopicState::Exists { partitions: None }),
        }
    }

    /// Gets ready to send at once (Kafka: the producer id).
    pub async fn warm_up(&self) {
        if let Sink::Kafka(sink) = self {
            sink.warm_up().await
        }
    }

    pub async fn close(self) {
        match self {
            Sink::Kafka(sink) => sink.close().await,
            Sink::RabbitMq(sink) => (*sink).close().await,
        }
    }

    /// Kafka's transactions (exactly-once); the config allows them on the Kafka sink only.
    fn transactional(&self) -> Result<&KafkaSink> {
        match self {
            Sink::Kafka(sink) => Ok(sink),
            _ => Err(Error::sink(
                "exactly-once on a sink without transactions (a bug)",
            )),
        }
    }

    pub async fn init_transactions(&self, limit: Duration) -> Result<()> {
        self.transactional()?.init_transactions(limit).await
    }

    pub fn begin(&self) -> Result<()> {
        self.transactional()?.begin()
    }

    pub async fn commit(&self, last: Record, limit: Duration) -> Result<()> {
        self.transactional()?.commit(last, limit).await
    }

    pub async fn abort(&self, limit: Duration) {
        if let Ok(sink) = self.transactional() {
            sink.abort(limit).await
        }
    }
}
