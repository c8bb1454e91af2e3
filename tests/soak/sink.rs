//! The server the soak's outboxd publishes to: Apache Kafka (one KRaft node) or Redis (Streams,
//! append-only file with `appendfsync always`, so an entry Redis acknowledged survives its
//! `kill -9`). The nemesis kills, restarts, freezes and thaws it the same way whichever it is.

use std::path::Path;

use crate::rig::redis::Redis;
use crate::rig::{create_topic_with, Broker};

/// The stream or topic the soak's rows go to (`outbox.event.` + their aggregate type).
pub const TOPIC: &str = "outbox.event.soak";
/// The topic's partitions (Kafka; a Redis stream is one ordered log, partition 0 here).
pub const PARTITIONS: i32 = 6;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sink {
    Kafka,
    Redis,
}

impl Sink {
    pub fn name(self) -> &'static str {
        match self {
            Sink::Kafka => "Apache Kafka",
            Sink::Redis => "Redis Streams",
        }
    }
}

pub enum SinkServer {
    Kafka(Broker),
    Redis(Redis),
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
        }
    }

    /// The broker, when it is Kafka (the operator's tools and the checker's reader need it).
    pub fn kafka(&self) -> Option<&Broker> {
        match self {
            SinkServer::Kafka(broker) => Some(broker),
            SinkServer::Redis(_) => None,
        }
    }

    pub fn kill9(&mut self) {
        match self {
            SinkServer::Kafka(broker) => broker.kill9(),
            SinkServer::Redis(redis) => redis.kill9(),
        }
    }

    /// Starts the killed server again on its own data.
    pub fn restart(&mut self) {
        match self {
            SinkServer::Kafka(broker) => broker.resume(),
            SinkServer::Redis(redis) => redis.boot(),
        }
    }

    pub fn freeze(&self) {
        match self {
            SinkServer::Kafka(broker) => broker.freeze(),
            SinkServer::Redis(redis) => redis.freeze(),
        }
    }

    pub fn thaw(&self) {
        match self {
            SinkServer::Kafka(broker) => broker.thaw(),
            SinkServer::Redis(redis) => redis.thaw(),
        }
    }

    /// Copies the server's logs into `dir` (`broker-N.log` / `redis.log`).
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
        }
    }
}
