//! The test rig: private servers on free loopback ports in temp dirs, torn down on drop (also on panic).
//!
//! - [`Mysqld`]: MariaDB (`mariadb-install-db` + `mariadbd`) or Oracle MySQL 9 (`scripts/mysql-9.sh`),
//!   with a ROW binlog; [`on_both_servers`] runs a test against each.
//! - [`Postgres`]: PostgreSQL 15 `initdb` + `pg_ctl` with `wal_level=logical` (run as the `postgres` OS user).
//! - [`Broker`]: Apache Kafka 4.x (KRaft, one node), assembled from Maven jars by `scripts/apache-kafka.sh`.
//! - [`cluster::Cluster`]: three Apache Kafka nodes, for replicated topics and rolling restarts.
//! - [`rabbitmq::RabbitMq`]: Debian's `rabbitmq-server`, one private node per test.
//! - [`nats::Nats`]: Debian's `nats-server` with JetStream, one private server per test.
//! - [`redis::Redis`]: Debian's `redis-server` (append-only, fsync always), one per test.
//! - [`moto::Moto`]: moto's server (PyPI), SQS and SNS in memory, one per test.
//! - [`debezium::Connect`]: Debezium under Kafka Connect standalone (Maven jars), beside outboxd.
//! - [`netns::NetNs`]: a network namespace and veth pair of the test's own, for network faults.
//! - [`Outboxd`]: the real `outboxd` binary with a config written for the test.
//! - [`consume`]: reads records back with a real rdkafka consumer.
//!
//! Nothing here talks to a service the machine may run; every address is 127.0.0.1, or the
//! address of a veth the test created itself.

pub mod broker;
pub mod certs;
pub mod cluster;
pub mod debezium;
pub mod disk;
pub mod kafka;
pub mod moto;
pub mod mysqld;
pub mod nats;
pub mod netns;
pub mod outboxd;
pub mod postgres;
pub mod rabbitmq;
pub mod redis;
pub mod scenario;

use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

pub use broker::Broker;
pub use kafka::{
    consume, consume_to_end, consume_using, create_topic, create_topic_using, create_topic_with,
    topic_end, Consumed, PAUSE, ROUND,
};
pub use mysqld::{Flavor, Mysqld};
pub use outboxd::Outboxd;
pub use postgres::Postgres;

/// One test, run against each MySQL-protocol server: `fn name(flavor: Flavor) { … }` becomes the
/// module `name` with the tests `mariadb` and `mysql`, so `cargo test` lists each server's run. The
/// MySQL run skips, printing why on the terminal, only when its installer could not reach Debian's
/// unstable suite (see [`Flavor::available`]).
#[macro_export]
macro_rules! on_both_servers {
    ($(#[$meta:meta])* fn $name:ident($flavor:ident: Flavor) $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            use $crate::rig::Flavor;

            $(#[$meta])*
            fn run($flavor: Flavor) $body

            #[test]
            fn mariadb() {
                run(Flavor::MariaDb)
            }

            #[test]
            fn mysql() {
                match Flavor::MySql.available() {
                    Ok(()) => run(Flavor::MySql),
                    Err(why) => $crate::rig::mysqld::skip(module_path!(), &why),
                }
            }
        }
    };
}

/// A free loopback port (bound and released; the server binds it right after).
pub fn free_port() -> u16 {
    // Every port is handed out once per run: the kernel may give a port just closed to the very
    // next bind, and two listeners of one server (a broker's PLAINTEXT and SASL_SSL) then asked
    // for the same port and the server refused to start.
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if GIVEN.lock().unwrap().insert(port) {
            return port;
        }
    }
}

#[test]
fn free_port_never_hands_out_a_port_twice() {
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..3000 {
        let port = free_port();
        assert!(seen.insert(port), "port {port} handed out twice");
    }
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

/// A plain HTTP/1.0 GET on 127.0.0.1:`port`: (status, body). (0, "") when nothing answers.
pub fn http_get(port: u16, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return (0, String::new());
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let _ = write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}
