//! The server the soak's outboxd publishes to: Apache Kafka (one KRaft node), Redis (Streams,
//! append-only file with `appendfsync always`, so an entry Redis acknowledged survives its
//! `kill -9`) or NATS JetStream (one file-backed stream; what it acknowledged is in its files, so
//! it survives the process's `kill -9`, not a host crash) or RabbitMQ (a durable topic exchange and
//! one durable queue bound to the soak's routing key; a publisher confirm means the node wrote the
//! message). The nemesis kills, restarts, freezes and
//! thaws it the same way whichever it is.

use std::path::Path;

use crate::rig::nats::Nats;
use crate::rig::rabbitmq::RabbitMq;
use crate::rig::redis::Redis;
use crate::rig::{create_topic_with, Broker};

/// The stream or topic the soak's rows go to (`outbox.event.` + their aggregate type).
pub const TOPIC: &str = "outbox.event.soak";
/// The topic's partitions (Kafka; a Redis or JetStream stream is one ordered log, partition 0
/// here).
pub const PARTITIONS: i32 = 6;
/// The JetStream stream that captures [`TOPIC`] (its subject), and the RabbitMQ queue bound to it
/// (its routing key).
pub const STREAM: &str = "SOAK";
/// The RabbitMQ exchange outboxd publishes to.
pub const EXCHANGE: &str = "outbox";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sink {
    Kafka,
    Redis,
    Nats,
    RabbitMq,
}

impl Sink {
    pub fn name(self) -> &'static str {
        match self {
            Sink::Kafka => "Apache Kafka",
            Sink::Redis => "Redis Streams",
            Sink::Nats => "NATS JetStream",
            Sink::RabbitMq => "RabbitMQ",
        }
    }
}

pub enum SinkServer {
    Kafka(Broker),
    Redis(Redis),
    Nats(Nats),
    RabbitMq(RabbitMq),
}

impl SinkServer {
    /// Starts `sink` listening on loopback and on `host` (the veth's host end), with the soak's
    /// topic created (Kafka: its append times are the broker's, which the checker compares with
    /// the faults' times; Redis stamps each entry id with its own clock).
    pub fn start_on(sink: Sink, host: &str) -> SinkServer {
        match sink {
            Sink::Kafka => {
                let broker = Broker::start_on(host, "");
                create_topic_with(
                    &broker.bootstrap(),
                    TOPIC,
                    PARTITIONS,
                    &[("message.timestamp.type", "LogAppendTime")],
                );
                SinkServer::Kafka(broker)
            }
            // Protected mode refuses clients from other addresses to a server without a password.
            Sink::Redis => SinkServer::Redis(Redis::start_with(
                None,
                &["--bind", "127.0.0.1", host, "--protected-mode", "no"],
                None,
            )),
            // Duplicate window 2 minutes, as the NATS sink's docs advise.
            Sink::Nats => {
                let nats = Nats::start_on(host);
                nats.add_stream(STREAM, &[TOPIC]);
                SinkServer::Nats(nats)
            }
            Sink::RabbitMq => {
                let rabbit = RabbitMq::start_on(host);
                rabbit.declare(EXCHANGE, &[(STREAM, TOPIC)]);
                SinkServer::RabbitMq(rabbit)
            }
        }
    }

    /// outboxd's config section for this server, reached at `host`.
    pub fn section(&self, host: &str, exactly_once: bool) -> String {
        match self {
            SinkServer::Kafka(broker) => format!(
                "[kafka]\nbrokers = \"{}\"\nexactly_once = {exactly_once}\n",
                broker.bootstrap()
            ),
            // Exactly-once on Redis comes from the checkpoint store (`store = "redis"`).
            SinkServer::Redis(redis) => {
                format!("[redis]\nurl = \"redis://{host}:{}/0\"\n", redis.port)
            }
            SinkServer::Nats(nats) => format!("[nats]\nurl = \"{}\"\n", nats.url()),
            SinkServer::RabbitMq(rabbit) => format!(
                "[rabbitmq]\nurl = \"{}\"\nexchange = \"{EXCHANGE}\"\n",
                rabbit.url_on(host)
            ),
        }
    }

    /// The broker, when it is Kafka (the operator's tools and the checker's reader need it).
    pub fn kafka(&self) -> Option<&Broker> {
        match self {
            SinkServer::Kafka(broker) => Some(broker),
            SinkServer::Redis(_) | SinkServer::Nats(_) | SinkServer::RabbitMq(_) => None,
        }
    }

    pub fn kill9(&mut self) {
        match self {
            SinkServer::Kafka(broker) => broker.kill9(),
            SinkServer::Redis(redis) => redis.kill9(),
            SinkServer::Nats(nats) => nats.kill9(),
            SinkServer::RabbitMq(rabbit) => rabbit.kill9(),
        }
    }

    /// Starts the killed server again on its own data.
    pub fn restart(&mut self) {
        match self {
            SinkServer::Kafka(broker) => broker.resume(),
            SinkServer::Redis(redis) => redis.boot(),
            SinkServer::Nats(nats) => nats.boot(),
            SinkServer::RabbitMq(rabbit) => rabbit.boot(),
        }
    }

    pub fn freeze(&self) {
        match self {
            SinkServer::Kafka(broker) => broker.freeze(),
            SinkServer::Redis(redis) => redis.freeze(),
            SinkServer::Nats(nats) => nats.freeze(),
            SinkServer::RabbitMq(rabbit) => rabbit.freeze(),
        }
    }

    pub fn thaw(&self) {
        match self {
            SinkServer::Kafka(broker) => broker.thaw(),
            SinkServer::Redis(redis) => redis.thaw(),
            SinkServer::Nats(nats) => nats.thaw(),
            SinkServer::RabbitMq(rabbit) => rabbit.thaw(),
        }
    }

    /// Copies the server's logs into `dir` (`broker-N.log`, `redis.log`, `nats-server.log` or `rabbitmq.log`).
    pub fn save_logs(&self, dir: &Path) {
        match self {
            SinkServer::Kafka(broker) => {
                for (n, log) in broker.logs().iter().enumerate() {
                    let _ = std::fs::copy(log, dir.join(format!("broker-{n}.log")));
                }
            }
            SinkServer::Redis(redis) => {
                let _ = std::fs::copy(redis.log_path(), dir.join("redis.log"));
            }
            SinkServer::Nats(nats) => {
                let _ = std::fs::copy(nats.log_path(), dir.join("nats-server.log"));
            }
            SinkServer::RabbitMq(rabbit) => {
                let _ = std::fs::copy(rabbit.log_path(), dir.join("rabbitmq.log"));
            }
        }
    }
}
