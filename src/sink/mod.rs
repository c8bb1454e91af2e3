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
//! Every sink but Kafka is a cargo feature of the same name (`aws` for SQS and SNS). A build
//! without one keeps its config section, so a config naming it parses and is refused by name
//! ([`SinkConfig::missing_feature`]); its client module and its [`Sink`] arm are left out.
//!
//! Two sinks can commit the checkpoint atomically with the records (exactly-once): Kafka in a
//! transaction (`kafka.exactly_once`), Redis in a `MULTI`/`EXEC` (`checkpoint.store = "redis"`).
//! The pipeline chooses the source transaction boundary; the sink gets the checkpoint as opaque
//! bytes in a [`CommitMark`], so positions still never reach it.

pub mod ack;
pub mod delivery;
pub mod kafka;
pub mod window;

#[cfg(feature = "aws")]
pub mod aws;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;
// Without its feature a sink is its config section alone.
#[cfg(not(feature = "aws"))]
pub mod aws {
    pub mod config;
}
#[cfg(not(feature = "nats"))]
pub mod nats {
    pub mod config;
}
#[cfg(not(feature = "rabbitmq"))]
pub mod rabbitmq {
    pub mod config;
}
#[cfg(not(feature = "redis"))]
pub mod redis {
    pub mod config;
}

use std::sync::Arc;
use std::time::Duration;

pub use ack::{Acks, Ticket};
pub use delivery::Delivery;
pub use window::Room;

use self::aws::config::{AwsConfig, Service};
#[cfg(feature = "aws")]
use self::aws::AwsSink;
use self::redis::config::RedisConfig;
#[cfg(feature = "redis")]
use self::redis::RedisSink;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::route::Record;
use kafka::config::KafkaConfig;
use kafka::{KafkaSink, TopicState};
use nats::config::NatsConfig;
#[cfg(feature = "nats")]
use nats::NatsSink;
use rabbitmq::config::RabbitMqConfig;
#[cfg(feature = "rabbitmq")]
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

/// The sinks this build has: every one with the default features (`outboxd --version` lists them).
pub fn built_sinks() -> Vec<&'static str> {
    let aws = cfg!(feature = "aws");
    [
        ("kafka", true),
        ("rabbitmq", cfg!(feature = "rabbitmq")),
        ("nats", cfg!(feature = "nats")),
        ("redis", cfg!(feature = "redis")),
        ("sqs", aws),
        ("sns", aws),
    ]
    .into_iter()
    .filter_map(|(name, built)| built.then_some(name))
    .collect()
}

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

    /// The cargo feature this sink needs, when this build lacks it.
    pub fn missing_feature(&self) -> Option<&'static str> {
        let (feature, built) = match self {
            SinkConfig::Kafka(_) => return None,
            SinkConfig::RabbitMq(_) => ("rabbitmq", cfg!(feature = "rabbitmq")),
            SinkConfig::Nats(_) => ("nats", cfg!(feature = "nats")),
            SinkConfig::Redis(_) => ("redis", cfg!(feature = "redis")),
            SinkConfig::Sqs(_) | SinkConfig::Sns(_) => ("aws", cfg!(feature = "aws")),
        };
        (!built).then_some(feature)
    }

    /// The refusal of a sink this build lacks.
    fn not_built(&self, feature: &str) -> delivery::Refusal {
        (
            self.name().to_string(),
            format!(
                "this outboxd was built without the `{feature}` feature, which the {} sink needs",
                self.name()
            ),
            format!("build it with the sink: cargo build --release --features {feature} (the default features have every sink)"),
        )
    }

    /// Checks the section's keys, and the header names the route adds (each broker has its own
    /// rules for them).
    pub fn validate(
        &self,
        route: &crate::route::RouteConfig,
        checkpoint_in_kafka: bool,
    ) -> std::result::Result<(), delivery::Refusal> {
        if let Some(feature) = self.missing_feature() {
            return Err(self.not_built(feature));
        }
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
            #[cfg(feature = "rabbitmq")]
            SinkConfig::RabbitMq(rabbitmq) => rabbitmq::preflight(rabbitmq).await,
            #[cfg(feature = "nats")]
            SinkConfig::Nats(nats) => {
                nats::preflight(nats, wanted.fixed_event_topic.as_deref()).await
            }
            #[cfg(feature = "redis")]
            SinkConfig::Redis(redis) => {
                self::redis::preflight(
                    redis,
                    wanted.fixed_event_topic.as_deref(),
                    wanted.checkpoint_in_redis,
                )
                .await
            }
            #[cfg(feature = "aws")]
            SinkConfig::Sqs(aws) => {
                aws::preflight(Service::Sqs, aws, wanted.fixed_event_topic.as_deref()).await
            }
            #[cfg(feature = "aws")]
            SinkConfig::Sns(aws) => {
                aws::preflight(Service::Sns, aws, wanted.fixed_event_topic.as_deref()).await
            }
            #[allow(unreachable_patterns)]
            other => {
                let (subject, why, fix) = other.not_built(other.missing_feature().unwrap_or("?"));
                vec![crate::preflight::Item::fail(&subject, why, fix)]
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
                    .with_max_header_bytes(rabbitmq::config::MAX_HEADER_BYTES)
            }
            SinkConfig::Nats(nats) => Router::new(route.clone(), nats.max_message_bytes)
                .with_max_header_bytes(nats::config::MAX_HEADER_BYTES),
            SinkConfig::Redis(redis) => Router::new(route.clone(), redis.max_message_bytes),
            SinkConfig::Sqs(aws) | SinkConfig::Sns(aws) => {
                Router::new(route.clone(), aws.max_message_bytes)
            }
        }
    }
}

/// One session's connection to the destination (an arm per sink this build has).
pub enum Sink {
    Kafka(KafkaSink),
    /// Boxed: the AMQP connection and channel handles are large, and the session holds one sink.
    #[cfg(feature = "rabbitmq")]
    RabbitMq(Box<RabbitMqSink>),
    #[cfg(feature = "nats")]
    Nats(Box<NatsSink>),
    #[cfg(feature = "redis")]
    Redis(Box<RedisSink>),
    /// SQS or SNS.
    #[cfg(feature = "aws")]
    Aws(Box<AwsSink>),
}

/// `$body` with `$sink` bound to whichever sink `$self` holds.
macro_rules! each_sink {
    ($self:expr, $sink:ident => $body:expr) => {
        match $self {
            Sink::Kafka($sink) => $body,
            #[cfg(feature = "rabbitmq")]
            Sink::RabbitMq($sink) => $body,
            #[cfg(feature = "nats")]
            Sink::Nats($sink) => $body,
            #[cfg(feature = "redis")]
            Sink::Redis($sink) => $body,
            #[cfg(feature = "aws")]
            Sink::Aws($sink) => $body,
        }
    };
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
        Ok(match config {
            SinkConfig::Kafka(kafka) => {
                let id = match transactional {
                    Some(Transactional::Kafka(id)) => Some(id.as_str()),
                    _ => None,
                };
                Sink::Kafka(KafkaSink::new(name, kafka, id, acks, metrics)?)
            }
            #[cfg(feature = "rabbitmq")]
            SinkConfig::RabbitMq(rabbitmq) => Sink::RabbitMq(Box::new(
                RabbitMqSink::new(name, rabbitmq, acks, metrics).await?,
            )),
            #[cfg(feature = "nats")]
            SinkConfig::Nats(nats) => {
                Sink::Nats(Box::new(NatsSink::new(name, nats, acks, metrics).await?))
            }
            #[cfg(feature = "redis")]
            SinkConfig::Redis(redis) => {
                let key = match transactional {
                    Some(Transactional::Redis(key)) => Some(key.as_str()),
                    _ => None,
                };
                Sink::Redis(Box::new(RedisSink::new(redis, key, acks, metrics).await?))
            }
            #[cfg(feature = "aws")]
            SinkConfig::Sqs(aws) => Sink::Aws(Box::new(
                AwsSink::new(Service::Sqs, aws, acks, metrics).await?,
            )),
            #[cfg(feature = "aws")]
            SinkConfig::Sns(aws) => Sink::Aws(Box::new(
                AwsSink::new(Service::Sns, aws, acks, metrics).await?,
            )),
            // Refused with the config already; kept for a config built by hand.
            #[allow(unreachable_patterns)]
            other => {
                let (_, why, fix) = other.not_built(other.missing_feature().unwrap_or("?"));
                return Err(Error::config(why).remedy(fix));
            }
        })
    }

    /// Waits for room in the window for `record`. Cancel-safe.
    pub async fn reserve(&self, record: &Record) -> Result<Room> {
        each_sink!(self, sink => sink.reserve(record).await)
    }

    /// Sends `record` in `room`; its acknowledgement hands `ticket` to the session's [`Acks`].
    pub async fn send(&self, room: Room, record: &Record, ticket: Ticket) -> Result<()> {
        each_sink!(self, sink => sink.send(room, record, ticket).await)
    }

    /// Whether `topic` can take records. Kafka says whether it exists; NATS refuses a subject
    /// whose stream's settings would lose what it acknowledges (see `NatsSink::topic_state`);
    /// the others answer per message (a return, no such queue), which their sinks handle.
    pub async fn topic_state(&self, topic: &str) -> Result<TopicState> {
        match self {
            Sink::Kafka(sink) => sink.topic_state(topic).await,
            #[cfg(feature = "nats")]
            Sink::Nats(sink) => sink.topic_state(topic).await,
            #[allow(unreachable_patterns)]
            _ => Ok(TopicState::Exists { partitions: None }),
        }
    }

    /// Gets ready to send at once (Kafka: the producer id).
    #[allow(irrefutable_let_patterns)] // a build with Kafka alone
    pub async fn warm_up(&self) {
        if let Sink::Kafka(sink) = self {
            sink.warm_up().await
        }
    }

    pub async fn close(self) {
        each_sink!(self, sink => sink.close().await)
    }

    /// What a failed session's error means once the producer's own state is known (Kafka: a
    /// fenced producer fails its deliveries with a bare `Fatal`; see `KafkaSink::explain_fatal`).
    pub fn explain_fatal(&self, e: Error) -> Error {
        match self {
            Sink::Kafka(sink) => sink.explain_fatal(e),
            #[allow(unreachable_patterns)]
            _ => e,
        }
    }

    /// Takes over the pipeline's transactions (Kafka: fences every earlier producer; Redis has
    /// nothing to take over: each commit compares the checkpoint it replaces).
    pub async fn init_transactions(&self, limit: Duration) -> Result<()> {
        match self {
            Sink::Kafka(sink) => sink.init_transactions(limit).await,
            #[allow(unreachable_patterns)]
            _ => Ok(()),
        }
    }

    /// Opens a transaction: the records sent from now on commit with the next [`CommitMark`].
    pub fn begin(&self) -> Result<()> {
        match self {
            Sink::Kafka(sink) => sink.begin(),
            #[cfg(feature = "redis")]
            Sink::Redis(sink) => sink.begin(),
            #[allow(unreachable_patterns)]
            _ => Err(no_transactions()),
        }
    }

    /// Commits the open transaction with `mark` (the checkpoint of its end), within `limit`.
    pub async fn commit(&self, mark: CommitMark, limit: Duration) -> Result<()> {
        match (self, mark) {
            (Sink::Kafka(sink), CommitMark::Record(last, index)) => {
                sink.commit(last, index, limit).await
            }
            #[cfg(feature = "redis")]
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
    #[allow(irrefutable_let_patterns)] // a build with Kafka alone
    pub async fn abort(&self, limit: Duration) {
        if let Sink::Kafka(sink) = self {
            sink.abort(limit).await
        }
    }
}

fn no_transactions() -> Error {
    Error::sink("a transaction on a sink without transactions (a bug)")
}
