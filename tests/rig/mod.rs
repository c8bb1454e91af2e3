//! The test rig: private servers on free loopback ports in temp dirs, torn down on drop (also on panic).
//!
//! - [`MariaDb`]: `mariadb-install-db` + `mariadbd` with a ROW binlog.
//! - [`Broker`]: the nisshi Kafka-protocol broker, in memory (built by `.ci/run`; see README).
//! - [`Outboxd`]: the real `outboxd` binary with a config written for the test.
//! - [`consume`]: reads records back with a real rdkafka consumer.
//!
//! Nothing here talks to a service the machine may run; every address is 127.0.0.1.
#![allow(dead_code)]

pub mod broker;
pub mod kafka;
pub mod mariadb;
pub mod outboxd;

use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

pub use broker::Broker;
pub use kafka::{consume, create_topic, create_topic_with, Consumed};
pub use mariadb::MariaDb;
pub use outboxd::Outboxd;

/// A free loopback port (bound and released; the server binds it right after).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls `condition` until it holds; panics with `what` after `limit`. The limit bounds the test, the
/// condition is the synchronisation.
pub fn wait_until(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    let start = Instant::now();
    while !condition() {
        if start.elapsed() > limit {
            panic!("timed out after {limit:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn file_contains(path: &Path, needle: &str) -> bool {
    std::fs::read_to_string(path).is_ok_and(|s| s.contains(needle))
}
