//! Sinks deliver routed records and report, per record, that the destination acknowledged it.
//!
//! The pipeline hands a sink each record with a [`Ticket`] (the record's place in source order) and
//! an [`Acks`] receiver; the sink hands the ticket back through [`Acks::acked`] when the destination
//! has the record, or reports [`Acks::failed`]. A sink never sees source positions: the ticket is
//! all it carries, so turning acks into a checkpoint stays the checkpoint's job.
//!
//! [`Sink`] is the one type the pipeline holds: one arm per broker, each a module of its own with
//! its config section (`config.rs`), its client and its `check` lines. Adding a sink is a module
//! and an arm here (and in [`SinkConfig`]); the pipeline does not change.
//!
//! Two sinks can commit the checkpoint atomically with the records (exactly-once): Kafka in a
//! transaction (`kafka.exactly_once`), Redis in a `MULTI`/`EXEC` (`checkpoint.store = "redis"`).
//! The pipeline chooses the source transaction boundary; the sink gets the checkpoint as opaque
//! bytes in a [`CommitMark`], so positions still never reach it.

pub mod ack;
pub mod aws;
pub mod delivery;
pub mod kafka;
pub mod nats;
pub mod rabbitmq;
pub mod redis;
pub mod window;

use std::sync::Arc;
use std::time::Duration;

pub use ack::{Acks, Ticket};
pub use delivery::Delivery;
pub use window::Room;

use self::aws::config::{AwsConfig, Service};
use self::aws::AwsSink;
use self::redis::config::RedisConfig;
use self::redis::RedisSink;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::route::Record;
use kafka::config::KafkaConfig;
use kafka::{KafkaSink, TopicState};
use nats::config::NatsConfig;
use nats::NatsSink;
use rabbitmq::config::RabbitMqConfig;
use rabbitmq::RabbitMqSink;

/// How a session's sink commits the checkpoint with the records it covers.
#[derive(Debug, Clone)]
pub enum Transactional {
    /// Kafka transactions under this `transactional.id`.
    Kafka(String),
    /// Redis `MULTI`/`EXEC`, with the checkpoint at this key.
    Redis(String),
}

/// The checkpoint, as opaque bytes in the form its sink commits it.
pub enum CommitMark {
    /// Kafka: the checkpoint record, the transaction's last, and the index its offset joins.
    Record(Record, kafka::index::RecordIndex),
    /// Redis: the checkpoint key's new value, applied only while the key still holds `expected`
    /// (what this instance last read or wrote there).
    /// `uncertain`: the body of the instance's last commit whose outcome is unknown (found at the
    /// key, it is this instance's own late commit, not another writer's).
    Key {
        body: Vec<u8>,
        expected: Option<Vec<u8>>,
        uncertain: Option<Vec<u8>>,
    },
}

/// The pipeline's sink section (exactly one per config).
#[derive(Debug, Clone, Copy)]
pub enum SinkConfig<'a> {
    Kafka(&'a KafkaConfig),
    RabbitMq(&'a RabbitMqConfig),
    Nats(&'a NatsConfig),
    Redis(&'a RedisConfig),
    Sqs(&'a AwsConfig),
    Sns(&'a AwsConfig),
}

/// Every sink's section name, as [`SinkConfig::name`] gives it (the `sink` label's values).
pub const SINK_NAMES: [&str; 6] = ["kafka", "rabbitmq", "nats", "redis", "sqs", "sns"];

impl SinkConfig<'_> {
    /// The section's name (one of [`SINK_NAMES`]).
    pub fn name(&self) -> &'static str {
        match self {
            SinkConfig::Kafka(_) => "kafka",
            SinkConfig::RabbitMq(_) => "rabbitmq",
            SinkConfig::Nats(_) => "nats",
            SinkConfig::Redis(_) => "redis",
            SinkConfig::Sqs(_) => "sqs",
            SinkConfig::Sns(_) => "sns",
        }
    }

    /// Checks the section's keys, and the header names the route adds (each broker has its own
    /// rules for them).
    pub fn validate(
        &self,
        route: &crate::route::RouteConfig,
        checkpoint_in_kafka: bool,
    ) -> std::result::Result<(), delivery::Refusal> {
        match self {
            SinkConfig::Kafka(kafka) => kafka.validate(checkpoint_in_kafka)?,
            SinkConfig::RabbitMq(rabbitmq) => rabbitmq.validate()?,
            SinkConfig::Nats(nats) => nats.validate()?,
            SinkConfig::Redis(redis) => redis.validate()?,
            SinkConfig::Sqs(aws) => aws.validate(Service::Sqs, route.header_names().count())?,
            SinkConfig::Sns(aws) => aws.validate(Service::Sns, route.header_names().count())?,
        }
        for header in route.header_names() {
            let refused = match self {
                SinkConfig::Kafka(_) => Ok(()),
                SinkConfig::RabbitMq(_) => RabbitMqConfig::validate_header_name(header),
                SinkConfig::Nats(_) => NatsConfig::validate_header_name(header),
                SinkConfig::Redis(_) => RedisConfig::validate_header_name(header),
                SinkConfig::Sqs(_) | SinkConfig::Sns(_) => AwsConfig::validate_header_name(header),
            };
            if let Err(why) = refused {
                let shown: String = header.chars().take(40).collect();
                return Err((
                    format!("route.headers.{shown}"),
                    why,
                    "pick another header name".into(),
                ));
            }
        }
        Ok(())
    }

    /// What every sink shares: the window, the drain deadline, the dead-letter destination.
    pub fn delivery(&self) -> Delivery {
        match self {
            SinkConfig::Kafka(kafka) => kafka.delivery(),
            SinkConfig::RabbitMq(rabbitmq) => rabbitmq.delivery(),
            SinkConfig::Nats(nats) => nats.delivery(),
            SinkConfig::Redis(redis) => redis.delivery(),
            SinkConfig::Sqs(aws) | SinkConfig::Sns(aws) => aws.delivery(),
        }
    }

    /// The secrets the section holds (for [`crate::secrets::register`]).
    pub fn secret_values(&self) -> Vec<String> {
        use crate::source::config::url_secrets;
        match self {
            SinkConfig::Kafka(kafka) => kafka.secret_values(),
            SinkConfig::RabbitMq(rabbitmq) => url_secrets(&rabbitmq.url),
            SinkConfig::Nats(nats) => nats::config::url_secrets(&nats.url)
                .into_iter()
                .chain(nats.token.clone())
                .collect(),
            SinkConfig::Redis(redis) => url_secrets(&redis.url),
            SinkConfig::Sqs(aws) | SinkConfig::Sns(aws) => aws.secret_values(),
        }
    }

    /// When its transactions commit (Kafka with `exactly_once`, Redis with the checkpoint in
    /// Redis); `None` for a sink without transactions.
    pub fn transaction_limits(&self) -> Option<delivery::TransactionLimits> {
        match self {
            SinkConfig::Kafka(kafka) => Some(kafka.transaction_limits()),
            SinkConfig::Redis(redis) => Some(redis.transaction_limits()),
            SinkConfig::RabbitMq(_)
            | SinkConfig::Nats(_)
            | SinkConfig::Sqs(_)
            | SinkConfig::Sns(_) => None,
        }
    }

    /// `check`'s lines for the sink.
    pub async fn preflight(&self, wanted: kafka::Wanted) -> Vec<crate::preflight::Item> {
        match self {
            SinkConfig::Kafka(kafka) => kafka::preflight(kafka, wanted).await,
            SinkConfig::RabbitMq(rabbitmq) => rabbitmq::preflight(rabbitmq).await,
            SinkConfig::Nats(nats) => {
                nats::preflight(nats, wanted.fixed_event_topic.as_deref()).await
            }
            SinkConfig::Redis(redis) => {
                self::redis::preflight(
                    redis,
                    wanted.fixed_event_topic.as_deref(),
                    wanted.checkpoint_in_redis,
                )
                .await
            }
            SinkConfig::Sqs(aws) => {
                aws::preflight(Service::Sqs, aws, wanted.fixed_event_topic.as_deref()).await
            }
            SinkConfig::Sns(aws) => {
                aws::preflight(Service::Sns, aws, wanted.fixed_event_topic.as_deref()).await
            }
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
            SinkConfig::Nats(nats) => Router::new(route.clone(), nats.max_message_bytes)
                .with_max_header_bytes(nats::MAX_HEADER_BYTES),
            SinkConfig::Redis(redis) => Router::new(route.clone(), redis.max_message_bytes),
            SinkConfig::Sqs(aws) | SinkConfig::Sns(aws) => {
                Router::new(route.clone(), aws.max_message_bytes)
            }
        }
    }
}

/// One session's connection to the destination.
pub enum Sink {
    Kafka(KafkaSink),
    /// Boxed: the AMQP connection and channel handles are large, and the session holds one sink.
    RabbitMq(Box<RabbitMqSink>),
    Nats(Box<NatsSink>),
    Redis(Box<RedisSink>),
    /// SQS or SNS.
    Aws(Box<AwsSink>),
}

impl Sink {
    /// The session's sink; `transactional` makes it commit the checkpoint with the records.
    pub async fn open(
        name: &str,
        config: SinkConfig<'_>,
        transactional: Option<&Transactional>,
        acks: Arc<dyn Acks>,
        metrics: Arc<Metrics>,
    ) -> Result<Sink> {
        let (kafka_id, redis_key) = match transactional {
            Some(Transactional::Kafka(id)) => (Some(id.as_str()), None),
            Some(Transactional::Redis(key)) => (None, Some(key.as_str())),
            None => (None, None),
        };
        Ok(match config {
            SinkConfig::Kafka(kafka) => {
                Sink::Kafka(KafkaSink::new(name, kafka, kafka_id, acks, metrics)?)
            }
            SinkConfig::RabbitMq(rabbitmq) => Sink::RabbitMq(Box::new(
                RabbitMqSink::new(name, rabbitmq, acks, metrics).await?,
            )),
            SinkConfig::Nats(nats) => {
                Sink::Nats(Box::new(NatsSink::new(name, nats, acks, metrics).await?))
            }
            SinkConfig::Redis(redis) => Sink::Redis(Box::new(
                RedisSink::new(redis, redis_key, acks, metrics).await?,
            )),
            SinkConfig::Sqs(aws) => Sink::Aws(Box::new(
                AwsSink::new(Service::Sqs, aws, acks, metrics).await?,
            )),
            SinkConfig::Sns(aws) => Sink::Aws(Box::new(
                AwsSink::new(Service::Sns, aws, acks, metrics).await?,
            )),
        })
    }

    /// Waits for room in the window for `record`. Cancel-safe.
    pub async fn reserve(&self, record: &Record) -> Result<Room> {
        match self {
            Sink::Kafka(sink) => sink.reserve(record).await,
            Sink::RabbitMq(sink) => sink.reserve(record).await,
            Sink::Nats(sink) => sink.reserve(record).await,
            Sink::Redis(sink) => sink.reserve(record).await,
            Sink::Aws(sink) => sink.reserve(record).await,
        }
    }

    /// Sends `record` in `room`; its acknowledgement hands `ticket` to the session's [`Acks`].
    pub async fn send(&self, room: Room, record: &Record, ticket: Ticket) -> Result<()> {
        match self {
            Sink::Kafka(sink) => sink.send(room, record, ticket).await,
            Sink::RabbitMq(sink) => sink.send(room, record, ticket).await,
            Sink::Nats(sink) => sink.send(room, record, ticket).await,
            Sink::Redis(sink) => sink.send(room, record, ticket).await,
            Sink::Aws(sink) => sink.send(room, record, ticket).await,
        }
    }

    /// Whether `topic` can take records. Kafka says whether it exists; NATS refuses a subject
    /// whose stream's settings would lose what it acknowledges (see `NatsSink::topic_state`);
    /// the others answer per message (a return, no such queue), which their sinks handle.
    pub async fn topic_state(&self, topic: &str) -> Result<TopicState> {
        match self {
            Sink::Kafka(sink) => sink.topic_state(topic).await,
            Sink::Nats(sink) => sink.topic_state(topic).await,
            Sink::RabbitMq(_) | Sink::Redis(_) | Sink::Aws(_) => {
                Ok(TopicState::Exists { partitions: None })
            }
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
            Sink::Nats(sink) => (*sink).close().await,
            Sink::Redis(sink) => (*sink).close().await,
            Sink::Aws(sink) => (*sink).close().await,
        }
    }

    /// What a failed session's error means once the producer's own state is known (Kafka: a
    /// fenced producer fails its deliveries with a bare `Fatal`; see `KafkaSink::explain_fatal`).
    pub fn explain_fatal(&self, e: Error) -> Error {
        match self {
            Sink::Kafka(sink) => sink.explain_fatal(e),
            _ => e,
        }
    }

    /// Takes over the pipeline's transactions (Kafka: fences every earlier producer; Redis has
    /// nothing to take over: each commit compares the checkpoint it replaces).
    pub async fn init_transactions(&self, limit: Duration) -> Result<()> {
        match self {
            Sink::Kafka(sink) => sink.init_transactions(limit).await,
            _ => Ok(()),
        }
    }

    /// Opens a transaction: the records sent from now on commit with the next [`CommitMark`].
    pub fn begin(&self) -> Result<()> {
        match self {
            Sink::Kafka(sink) => sink.begin(),
            Sink::Redis(sink) => sink.begin(),
            _ => Err(no_transactions()),
        }
    }

    /// Commits the open transaction with `mark` (the checkpoint of its end), within `limit`.
    pub async fn commit(&self, mark: CommitMark, limit: Duration) -> Result<()> {
        match (self, mark) {
            (Sink::Kafka(sink), CommitMark::Record(last, index)) => {
                sink.commit(last, index, limit).await
            }
            (
                Sink::Redis(sink),
                CommitMark::Key {
                    body,
                    expected,
                    uncertain,
                },
            ) => sink.commit(body, expected, uncertain, limit).await,
            _ => Err(no_transactions()),
        }
    }

    /// Gives up the open transaction (best effort: a Kafka transaction is aborted by the next
    /// session's start otherwise; a Redis one dies with its connection at `close`).
    pub async fn abort(&self, limit: Duration) {
        if let Sink::Kafka(sink) = self {
            sink.abort(limit).await
        }
    }
}

fn no_transactions() -> Error {
    Error::sink("a transaction on a sink without transactions (a bug)")
}
