//! The Kafka-protocol brokers of the tests, on free loopback ports: nisshi (in memory, the default)
//! and noida-db (transactions, for the Kafka checkpoint store and exactly-once).

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, wait_until};

pub struct Broker {
    pub port: u16,
    child: Child,
    _log: tempfile::NamedTempFile,
    /// noida-db's data directory (fresh per broker).
    _data: Option<tempfile::TempDir>,
}

/// Where `install-test-deps.sh` puts noida-db's server binary; `OUTBOXD_TEST_NOIDA` overrides.
pub fn noida_binary() -> PathBuf {
    if let Ok(path) = std::env::var("OUTBOXD_TEST_NOIDA") {
        return PathBuf::from(path);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    PathBuf::from(home).join(".cache/outboxd-test/noida-db-0.2.3/noida-db")
}

/// Where `.ci/run` installs the broker; `OUTBOXD_TEST_BROKER` overrides.
pub fn broker_binary() -> PathBuf {
    if let Ok(path) = std::env::var("OUTBOXD_TEST_BROKER") {
        return PathBuf::from(path);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    PathBuf::from(home).join(".cache/outboxd-test/nisshi-0.8.1/bin/nisshi")
}

impl Broker {
    pub fn start() -> Broker {
        Broker::start_advertising(None)
    }

    /// A broker that tells clients to reach it at `advertised` (a TLS terminator's port in front of
    /// it) instead of its own port.
    pub fn start_advertising(advertised: Option<u16>) -> Broker {
        let bin = broker_binary();
        assert!(
            bin.exists(),
            "test broker not found at {}: run ./scripts/test.sh (it installs it) or set OUTBOXD_TEST_BROKER",
            bin.display()
        );
        let port = free_port();
        let url = format!("tcp://127.0.0.1:{port}");
        let advertised_url = format!("tcp://127.0.0.1:{}", advertised.unwrap_or(port));
        let log = tempfile::NamedTempFile::new().unwrap();
        let child = Command::new(bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &advertised_url,
            ])
            .args([
                "--storage-engine",
                "memory://nisshi/",
                "--group-initial-rebalance-delay",
                "0s",
            ])
            .stdout(Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .expect("start the broker");
        wait_until("the broker to listen", Duration::from_secs(30), || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        Broker {
            port,
            child,
            _log: log,
            _data: None,
        }
    }

    /// noida-db: a Kafka-protocol broker with transactions (keep its data small: it holds
    /// everything in memory and ignores fetch.max.bytes).
    pub fn start_noida() -> Broker {
        let bin = noida_binary();
        assert!(
            bin.exists(),
            "noida-db not found at {}: run ./scripts/test.sh (it installs it) or set OUTBOXD_TEST_NOIDA",
            bin.display()
        );
        let port = free_port();
        let data = tempfile::Builder::new()
            .prefix("outboxd-noida-")
            .tempdir()
            .unwrap();
        let log = tempfile::NamedTempFile::new().unwrap();
        let child = Command::new(bin)
            .args([
                "start",
                "--host",
                "127.0.0.1",
                "--only",
                "kafka",
                "--kafka-port",
            ])
            .arg(port.to_string())
            .arg("--data-dir")
            .arg(data.path())
            .stdout(log.reopen().unwrap())
            .stderr(log.reopen().unwrap())
            .spawn()
            .expect("start noida-db");
        wait_until("noida-db to listen", Duration::from_secs(30), || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        Broker {
            port,
            child,
            _log: log,
            _data: Some(data),
        }
    }

    /// The broker process (signals; CPU accounting in the benchmark).
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGSTOP: the broker keeps its sockets but answers nothing (an outage as clients see it,
    /// without losing the records it holds in memory).
    pub fn freeze(&self) {
        let pid = nix::unistd::Pid::from_raw(self.pid());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    }

    pub fn thaw(&self) {
        let pid = nix::unistd::Pid::from_raw(self.pid());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    }

    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.thaw();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
