//! A private RabbitMQ (Debian's `rabbitmq-server`) on free loopback ports, and an AMQP client to
//! declare, bind and read back with (lapin, the library the sink uses).
//!
//! The node is private: its own name, Mnesia and log directories and Erlang cookie (`HOME`) under a
//! temp dir, and its own `epmd` on a free port, started here in the foreground (RabbitMQ would
//! otherwise start a daemonised one that outlives the test). Both run in one process group, which
//! [`RabbitMq::kill9`], [`RabbitMq::freeze`] and drop signal as a whole.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::{free_port, Consumed};

pub struct RabbitMq {
    dir: tempfile::TempDir,
    pub port: u16,
    user: String,
    password: String,
    epmd_port: u16,
    dist_port: u16,
    /// The TLS listener's port ([`RabbitMq::start_tls`]).
    pub tls_port: u16,
    children: Vec<Child>,
}

/// A message read back from a queue.
pub struct Got {
    pub routing_key: String,
    pub message_id: Option<String>,
    pub delivery_mode: Option<u8>,
    pub headers: BTreeMap<String, Option<Vec<u8>>>,
    pub body: Vec<u8>,
}

impl Got {
    /// As a Kafka record would read (routing key as topic, the `key` header as key), so that the
    /// Kafka tests' checks apply.
    pub fn as_consumed(&self, offset: i64) -> Consumed {
        let mut headers = self.headers.clone();
        let key = headers.remove("outboxd.key").flatten();
        Consumed {
            topic: self.routing_key.clone(),
            partition: 0,
            offset,
            key,
            value: Some(self.body.clone()),
            headers,
            timestamp: None,
        }
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.as_ref())
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }
}

impl RabbitMq {
    pub fn start() -> RabbitMq {
        Self::start_with_user("guest", "guest")
    }

    /// A node whose one user is `user`/`password` (administrator of vhost `/`).
    pub fn start_with_user(user: &str, password: &str) -> RabbitMq {
        Self::start_with(user, password, None, "")
    }

    /// A node with `conf` appended to its rabbitmq.conf (e.g. `max_message_size = 1048576`).
    pub fn start_with_conf(conf: &str) -> RabbitMq {
        Self::start_with("guest", "guest", None, conf)
    }

    /// A node listening on `host` too (a network namespace's host end), same port.
    pub fn start_on(host: &str) -> RabbitMq {
        Self::start_with(
            "guest",
            "guest",
            None,
            &format!("listeners.tcp.also = {host}:PORT\n"),
        )
    }

    /// A node with a TLS listener too (on [`RabbitMq::tls_port`]) presenting `server`, signed by
    /// the CA in `ca_pem`.
    pub fn start_tls(ca_pem: &std::path::Path, server: &super::certs::Issued) -> RabbitMq {
        Self::start_with("guest", "guest", Some((ca_pem, server)), "")
    }

    fn start_with(
        user: &str,
        password: &str,
        tls: Option<(&std::path::Path, &super::certs::Issued)>,
        conf: &str,
    ) -> RabbitMq {
        // A node that does not take logins in time (a port taken between picking and binding it,
        // or a machine too loaded) is started once more, afresh, on other ports.
        for attempt in 1..=2 {
            let mut rabbit = Self::configure(user, password, tls, conf);
            if rabbit.try_boot(Duration::from_secs(90)) {
                return rabbit;
            }
            let log =
                std::fs::read_to_string(rabbit.dir.path().join("server.out")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            eprintln!(
                "RabbitMQ (attempt {attempt}) took no login within 90 s; its output ends:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
            rabbit.kill9();
        }
        panic!("RabbitMQ took no AMQP login within 90 s, twice");
    }

    /// A node's directory and configuration, on fresh ports (not started).
    fn configure(
        user: &str,
        password: &str,
        tls: Option<(&std::path::Path, &super::certs::Issued)>,
        conf: &str,
    ) -> RabbitMq {
        let dir = tempfile::tempdir().unwrap();
        let rabbit = RabbitMq {
            dir,
            port: free_port(),
            user: user.into(),
            password: password.into(),
            epmd_port: free_port(),
            dist_port: free_port(),
            tls_port: free_port(),
            children: Vec::new(),
        };
        let tls_listener = match tls {
            Some((ca, server)) => format!(
                "listeners.ssl.default = 127.0.0.1:{}\nssl_options.cacertfile = {}\nssl_options.certfile = {}\nssl_options.keyfile = {}\nssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\n",
                rabbit.tls_port,
                ca.display(),
                server.cert.display(),
                server.key.display()
            ),
            None => String::new(),
        };
        std::fs::write(
            rabbit.dir.path().join("rabbitmq.conf"),
            format!(
                "listeners.tcp.default = 127.0.0.1:{}\nloopback_users = none\ndefault_user = {}\ndefault_pass = {}\n{tls_listener}{}",
                rabbit.port,
                rabbit.user,
                rabbit.password,
                // `PORT`: the node's AMQP port, for listeners added by the caller.
                conf.replace(":PORT", &format!(":{}", rabbit.port))
            ),
        )
        .unwrap();
        std::fs::write(rabbit.dir.path().join("enabled_plugins"), "[].\n").unwrap();
        rabbit
    }

    /// Starts epmd and the node (again, after [`RabbitMq::kill9`]: same node, same data).
    pub fn boot(&mut self) {
        assert!(
            self.try_boot(Duration::from_secs(90)),
            "timed out after 90s waiting for RabbitMQ to accept AMQP logins"
        );
    }

    /// [`RabbitMq::boot`]; `false` when the node took no login within `limit`.
    fn try_boot(&mut self, limit: Duration) -> bool {
        let dir = self.dir.path();
        let epmd = Command::new("epmd")
            .args([
                "-port",
                &self.epmd_port.to_string(),
                "-address",
                "127.0.0.1",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("epmd runs (rabbitmq-server's Erlang; scripts/install-test-deps.sh)");
        let group = epmd.id() as i32;
        let listening = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.epmd_port)).is_err() {
            if listening.elapsed() > Duration::from_secs(10) {
                self.children = vec![epmd];
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let log = std::fs::File::create(dir.join("server.out")).unwrap();
        let server = Command::new("/usr/lib/rabbitmq/bin/rabbitmq-server")
            .env("HOME", dir)
            .env(
                "RABBITMQ_NODENAME",
                format!("outboxd{}@localhost", self.port),
            )
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("ERL_EPMD_PORT", self.epmd_port.to_string())
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .env("RABBITMQ_CONF_ENV_FILE", dir.join("rabbitmq-env.conf"))
            .env("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", "-start_epmd false")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(group)
            .spawn()
            .expect("rabbitmq-server runs (scripts/install-test-deps.sh installs it)");
        self.children = vec![epmd, server];
        let started = std::time::Instant::now();
        while started.elapsed() < limit {
            let login = block_on(async {
                let c = Connection::connect(&self.url(), ConnectionProperties::default()).await?;
                c.close(200, "ready".into()).await
            });
            if login.is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// `amqp://user:password@127.0.0.1:PORT/%2f`.
    pub fn url(&self) -> String {
        format!(
            "amqp://{}:{}@127.0.0.1:{}/%2f",
            self.user, self.password, self.port
        )
    }

    /// `amqp://user:password@HOST:PORT/%2f`: the listener [`RabbitMq::start_on`] added.
    pub fn url_on(&self, host: &str) -> String {
        format!(
            "amqp://{}:{}@{host}:{}/%2f",
            self.user, self.password, self.port
        )
    }

    pub fn log_path(&self) -> std::path::PathBuf {
        self.dir.path().join("server.out")
    }

    /// `amqps://user:password@HOST:TLS_PORT/%2f` (`host` is what the certificate is checked
    /// against).
    pub fn tls_url(&self, host: &str) -> String {
        format!(
            "amqps://{}:{}@{host}:{}/%2f",
            self.user, self.password, self.tls_port
        )
    }

    pub fn log(&self) -> String {
        let mut text =
            std::fs::read_to_string(self.dir.path().join("server.out")).unwrap_or_default();
        if let Ok(entries) = std::fs::read_dir(self.dir.path().join("log")) {
            for entry in entries.flatten() {
                text.push_str(&std::fs::read_to_string(entry.path()).unwrap_or_default());
            }
        }
        text
    }

    fn group(&self) -> Option<Pid> {
        self.children.first().map(|c| Pid::from_raw(c.id() as i32))
    }

    /// SIGKILL to the node and its epmd (messages it confirmed are on disk).
    pub fn kill9(&mut self) {
        if let Some(group) = self.group() {
            let _ = killpg(group, Signal::SIGCONT);
            let _ = killpg(group, Signal::SIGKILL);
        }
        for mut child in self.children.drain(..) {
            let _ = child.wait();
        }
    }

    pub fn freeze(&self) {
        if let Some(group) = self.group() {
            killpg(group, Signal::SIGSTOP).unwrap();
        }
    }

    pub fn thaw(&self) {
        if let Some(group) = self.group() {
            let _ = killpg(group, Signal::SIGCONT);
        }
    }

    async fn connect(&self) -> Connection {
        Connection::connect(&self.url(), ConnectionProperties::default())
            .await
            .expect("connecting to the test RabbitMQ")
    }

    /// A durable topic exchange `exchange` and, per `(queue, binding key)`, a durable queue bound
    /// to it.
    pub fn declare(&self, exchange: &str, bindings: &[(&str, &str)]) {
        block_on(async {
            let connection = self.connect().await;
            let channel = connection.create_channel().await.unwrap();
            channel
                .exchange_declare(
                    exchange.into(),
                    ExchangeKind::Topic,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
            for (queue, key) in bindings {
                channel
                    .queue_declare(
                        (*queue).into(),
                        QueueDeclareOptions {
                            durable: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .unwrap();
                channel
                    .queue_bind(
                        (*queue).into(),
                        exchange.into(),
                        (*key).into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .unwrap();
            }
            connection.close(200, "declared".into()).await.unwrap();
        });
    }

    /// A durable queue `queue` bound to `exchange` with `key`, holding at most `max_length`
    /// messages and refusing (nacking) publishes while full (`x-overflow = reject-publish`).
    pub fn declare_limited(&self, exchange: &str, queue: &str, key: &str, max_length: i64) {
        block_on(async {
            let connection = self.connect().await;
            let channel = connection.create_channel().await.unwrap();
            let mut args = FieldTable::default();
            args.insert("x-max-length".into(), AMQPValue::LongLongInt(max_length));
            args.insert(
                "x-overflow".into(),
                AMQPValue::LongString("reject-publish".into()),
            );
            channel
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    args,
                )
                .await
                .unwrap();
            channel
                .queue_bind(
                    queue.into(),
                    exchange.into(),
                    key.into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            connection.close(200, "declared".into()).await.unwrap();
        });
    }

    /// How many messages `queue` holds.
    pub fn queue_len(&self, queue: &str) -> u32 {
        block_on(async {
            let connection = self.connect().await;
            let channel = connection.create_channel().await.unwrap();
            let queue = channel
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
            let _ = connection.close(200, "counted".into()).await;
            queue.message_count()
        })
    }

    /// Reads (and acknowledges) messages from `queue` until at least `expected` arrived and
    /// nothing more came for 2 s (duplicates are read too), or `limit` passed.
    pub fn read(&self, queue: &str, expected: usize, limit: Duration) -> Vec<Got> {
        block_on(async {
            let connection = self.connect().await;
            let channel = connection.create_channel().await.unwrap();
            let mut got = Vec::new();
            let start = std::time::Instant::now();
            let mut quiet_since = std::time::Instant::now();
            loop {
                let message = channel
                    .basic_get(queue.into(), BasicGetOptions { no_ack: true })
                    .await
                    .unwrap();
                match message {
                    Some(m) => {
                        quiet_since = std::time::Instant::now();
                        let delivery = m.delivery;
                        let headers = delivery
                            .properties
                            .headers()
                            .as_ref()
                            .map(|t| {
                                t.inner()
                                    .iter()
                                    .map(|(k, v)| (k.to_string(), header_bytes(v)))
                                    .collect()
                            })
                            .unwrap_or_default();
                        got.push(Got {
                            routing_key: delivery.routing_key.to_string(),
                            message_id: delivery
                                .properties
                                .message_id()
                                .as_ref()
                                .map(|s| s.to_string()),
                            delivery_mode: *delivery.properties.delivery_mode(),
                            headers,
                            body: delivery.data,
                        });
                    }
                    None if got.len() >= expected
                        && quiet_since.elapsed() > Duration::from_secs(2) =>
                    {
                        break
                    }
                    None if start.elapsed() > limit => break,
                    None => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
            let _ = connection.close(200, "read".into()).await;
            got
        })
    }
}

impl RabbitMq {
    /// Empties `queue` (the benchmark's, between runs).
    #[allow(dead_code)]
    pub fn purge(&self, queue: &str) {
        block_on(async {
            let connection = self.connect().await;
            let channel = connection.create_channel().await.unwrap();
            channel
                .queue_purge(queue.into(), lapin::options::QueuePurgeOptions::default())
                .await
                .unwrap();
            let _ = connection.close(200, "purged".into()).await;
        })
    }
}

fn header_bytes(value: &AMQPValue) -> Option<Vec<u8>> {
    match value {
        AMQPValue::Void => None,
        AMQPValue::LongString(s) => Some(s.as_bytes().to_vec()),
        AMQPValue::ByteArray(b) => Some(b.as_slice().to_vec()),
        other => Some(format!("{other:?}").into_bytes()),
    }
}

/// Runs `future` on a runtime of its own (the tests are synchronous).
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(future)
}

impl Drop for RabbitMq {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The rig's config for a MariaDB pipeline publishing to `rabbitmq` (`extra` goes into the
/// `[rabbitmq]` section).
pub fn config_with_rabbitmq(db_url: &str, rabbitmq: &str, extra: &str) -> String {
    format!(
        "[source]\nkind = \"mysql\"\nurl = \"{db_url}\"\ntables = [\"app.outbox\"]\nserver_id = 99\nheartbeat_interval_ms = 1000\n\
         [rabbitmq]\nurl = \"{rabbitmq}\"\nexchange = \"outbox\"\n{extra}\n[http]\nlisten = \"\"\n"
    )
}
