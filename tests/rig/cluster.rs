//! Apache Kafka as three KRaft nodes on loopback (each broker and controller), for what a single
//! broker cannot show: replicated topics, a partition leader or transaction coordinator that moves,
//! a broker restarted while the others serve. Started through `scripts/apache-kafka.sh` like
//! [`super::Broker`] (`run` with a node id, `resume` to restart one with its data); killed on drop.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;

use super::broker::small_jvm;
use super::{file_contains, free_port, wait_until};

struct Node {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

pub struct Cluster {
    nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

fn script() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/apache-kafka.sh")
}

impl Cluster {
    /// Three nodes; internal topics (transaction state, offsets) with three replicas, two in sync.
    pub fn start() -> Cluster {
        super::broker::kafka_home();
        let dir = tempfile::Builder::new()
            .prefix("outboxd-kafka-cluster-")
            .tempdir()
            .unwrap();
        let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
        let voters = ports
            .iter()
            .enumerate()
            .map(|(i, (_, c))| format!("{}@127.0.0.1:{c}", i + 1))
            .collect::<Vec<_>>()
            .join(",");
        let mut nodes = Vec::new();
        for (i, (port, controller)) in ports.iter().enumerate() {
            let node_dir = dir.path().join(format!("node{}", i + 1));
            let properties = dir.path().join(format!("node{}.properties", i + 1));
            std::fs::write(
                &properties,
                format!(
                    "controller.quorum.voters={voters}\n\
                     listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}\n\
                     advertised.listeners=PLAINTEXT://127.0.0.1:{port}\n\
                     listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n\
                     inter.broker.listener.name=PLAINTEXT\n\
                     offsets.topic.replication.factor=3\n\
                     transaction.state.log.replication.factor=3\n\
                     transaction.state.log.min.isr=2\n\
                     controlled.shutdown.enable=true\n"
                ),
            )
            .unwrap();
            let mut command = Command::new(script());
            command
                .arg("run")
                .arg(&node_dir)
                .args([port.to_string(), controller.to_string()])
                .arg(&properties)
                .env("KAFKA_NODE_ID", (i + 1).to_string())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            small_jvm(&mut command);
            let child = command.spawn().expect("start a Kafka node");
            nodes.push(Node {
                port: *port,
                dir: node_dir,
                child: Some(child),
            });
        }
        let cluster = Cluster { nodes, _dir: dir };
        for i in 0..3 {
            cluster.wait_serving(i);
        }
        wait_until(
            "the three brokers to know each other",
            Duration::from_secs(60),
            || cluster.brokers_known() == 3,
        );
        cluster
    }

    fn wait_serving(&self, i: usize) {
        let node = &self.nodes[i];
        let log = node.dir.join("server.log");
        wait_until(
            &format!("Kafka node {} to serve", i + 1),
            Duration::from_secs(120),
            || {
                file_contains(&log, "Kafka Server started")
                    && TcpStream::connect(("127.0.0.1", node.port)).is_ok()
            },
        );
    }

    pub fn bootstrap(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A topic with three replicas, two of which must have a record before it is acknowledged.
    pub fn create_topic(&self, topic: &str, partitions: i32) {
        use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
        use rdkafka::client::DefaultClientContext;
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .create()
            .unwrap();
        let results = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(
                admin.create_topics(
                    &[NewTopic::new(topic, partitions, TopicReplication::Fixed(3))
                        .set("min.insync.replicas", "2")],
                    &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
                ),
            )
            .unwrap();
        for r in results {
            r.unwrap();
        }
    }

    fn consumer(&self) -> BaseConsumer {
        ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("group.id", "rig-cluster")
            .create()
            .unwrap()
    }

    fn brokers_known(&self) -> usize {
        self.consumer()
            .fetch_metadata(None, Duration::from_secs(5))
            .map_or(0, |m| m.brokers().len())
    }

    /// Every partition of every topic has all its replicas in sync (after a restarted broker caught up).
    pub fn fully_replicated(&self) -> bool {
        let Ok(metadata) = self.consumer().fetch_metadata(None, Duration::from_secs(5)) else {
            return false;
        };
        metadata.brokers().len() == 3
            && metadata.topics().iter().all(|t| {
                t.partitions()
                    .iter()
                    .all(|p| p.leader() >= 0 && p.isr().len() == p.replicas().len())
            })
    }

    /// Stops node `i` (0-based) with SIGTERM (a controlled shutdown: its partitions' leadership
    /// moves first) and starts it again with its data, then waits until every replica is back in
    /// sync.
    pub fn restart(&mut self, i: usize) {
        self.restart_after(i, nix::sys::signal::Signal::SIGTERM);
    }

    /// [`Cluster::restart`] after SIGKILL: no controlled shutdown, the others learn of it when its
    /// session times out.
    pub fn restart_killed(&mut self, i: usize) {
        self.restart_after(i, nix::sys::signal::Signal::SIGKILL);
    }

    /// The node (0-based) leading `topic`'s `partition` (once it has a leader).
    pub fn leader_of(&self, topic: &str, partition: i32) -> usize {
        let mut leader = -1;
        wait_until(
            &format!("{topic}/{partition} to have a leader"),
            Duration::from_secs(60),
            || {
                leader = self
                    .consumer()
                    .fetch_metadata(Some(topic), Duration::from_secs(10))
                    .ok()
                    .and_then(|m| {
                        let t = m.topics().first()?;
                        Some(
                            t.partitions()
                                .iter()
                                .find(|p| p.id() == partition)?
                                .leader(),
                        )
                    })
                    .unwrap_or(-1);
                leader >= 1
            },
        );
        (leader - 1) as usize
    }

    fn restart_after(&mut self, i: usize, signal: nix::sys::signal::Signal) {
        self.stop(i, signal);
        self.resume(i);
    }

    /// SIGSTOP (`true`) or SIGCONT (`false`) to node `i`: it keeps its sockets and answers nothing.
    pub fn freeze(&self, i: usize, frozen: bool) {
        let child = self.nodes[i].child.as_ref().expect("node running");
        let signal = if frozen {
            nix::sys::signal::Signal::SIGSTOP
        } else {
            nix::sys::signal::Signal::SIGCONT
        };
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal).unwrap();
    }

    /// Stops node `i` (0-based) with `signal` and waits for its exit.
    pub fn stop(&mut self, i: usize, signal: nix::sys::signal::Signal) {
        let node = &mut self.nodes[i];
        let mut child = node.child.take().expect("node running");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal).unwrap();
        child.wait().unwrap();
    }

    /// Starts stopped nodes again with their data, then waits until they serve and every replica
    /// is in sync.
    pub fn resume(&mut self, i: usize) {
        self.resume_all(&[i]);
    }

    pub fn resume_all(&mut self, which: &[usize]) {
        for &i in which {
            let node = &mut self.nodes[i];
            assert!(node.child.is_none(), "node {} is running", i + 1);
            let _ = std::fs::remove_file(node.dir.join("server.log"));
            let mut command = Command::new(script());
            command
                .arg("resume")
                .arg(&node.dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            small_jvm(&mut command);
            node.child = Some(command.spawn().expect("restart a Kafka node"));
        }
        for &i in which {
            self.wait_serving(i);
        }
        wait_until(
            "every replica to be in sync again",
            Duration::from_secs(120),
            || self.fully_replicated(),
        );
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(child.id() as i32),
                    nix::sys::signal::Signal::SIGCONT,
                );
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}
