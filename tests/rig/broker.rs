//! Apache Kafka, the broker users run: one KRaft node (broker and controller) per test, on free
//! loopback ports, in a temp dir, started through `scripts/apache-kafka.sh run` (which owns its
//! configuration and formats its log directory) and killed on drop, also on panic.
//!
//! Each test gets a private broker rather than one per binary: the tests use Debezium's default
//! topic names (`outbox.event.<type>`), freeze the broker, and read topics from the beginning, so
//! sharing would need every topic and pipeline renamed; a broker starts in about 2.5 s here.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::certs::Issued;
use super::{file_contains, free_port, wait_until};

pub struct Broker {
    /// The PLAINTEXT listener.
    pub port: u16,
    /// The SSL listener, when the broker has one ([`Broker::start_tls`]).
    pub tls_port: Option<u16>,
    /// The address every listener binds (127.0.0.1 unless [`Broker::start_on`] named another).
    host: String,
    child: Child,
    _dir: tempfile::TempDir,
}

/// The script that assembles and starts Apache Kafka (the one the benchmark and users call too).
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/apache-kafka.sh")
}

/// A test broker holds little: a small heap and a JIT that starts fast, unless the environment
/// says otherwise (the benchmark sets Kafka's own defaults: benches/run.sh).
pub fn small_jvm(command: &mut Command) {
    if std::env::var_os("KAFKA_HEAP_OPTS").is_none() {
        command.env("KAFKA_HEAP_OPTS", "-Xms64m -Xmx512m");
    }
    if std::env::var_os("KAFKA_JVM_PERFORMANCE_OPTS").is_none() {
        command.env(
            "KAFKA_JVM_PERFORMANCE_OPTS",
            "-XX:+UseSerialGC -XX:TieredStopAtLevel=1 -XX:-UsePerfData",
        );
    }
}

/// Where the assembled Apache Kafka lives (its `lib/` holds the Java tools too).
pub fn kafka_home() -> PathBuf {
    let out = Command::new(script())
        .arg("install")
        .stderr(Stdio::inherit())
        .output()
        .expect("scripts/apache-kafka.sh install");
    assert!(
        out.status.success(),
        "scripts/apache-kafka.sh install failed"
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// `-XX:SharedArchiveFile=…` when `scripts/apache-kafka.sh install` wrote a class-data archive for
/// this JDK (a Kafka tool then starts on less CPU, as the brokers do); nothing otherwise.
pub fn class_data_archive() -> Vec<String> {
    static ARCHIVE: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    ARCHIVE
        .get_or_init(|| {
            let out = Command::new(script())
                .arg("archive")
                .stderr(Stdio::inherit())
                .output()
                .expect("scripts/apache-kafka.sh archive");
            let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
            match path.is_empty() {
                true => Vec::new(),
                false => vec![format!("-XX:SharedArchiveFile={path}")],
            }
        })
        .clone()
}

impl Broker {
    pub fn start() -> Broker {
        Broker::launch(None)
    }

    /// A broker with more `server.properties` lines (e.g. a lower `transaction.max.timeout.ms`).
    pub fn start_with(properties: &str) -> Broker {
        Broker::launch_with(None, properties)
    }

    /// A broker whose listeners bind (and advertise) `host` rather than 127.0.0.1: the address of a
    /// veth the test made, so that an outboxd in another network namespace can reach it.
    pub fn start_on(host: &str, properties: &str) -> Broker {
        Broker::launch_on(host, None, properties)
    }

    /// A broker with an SSL listener too (its own, not a terminator in front of it), presenting
    /// `server` (PEM certificate and PKCS#8 key). [`Broker::tls_bootstrap`] is its address.
    pub fn start_tls(server: &Issued) -> Broker {
        Broker::launch(Some(("SSL", server, String::new())))
    }

    /// A broker whose second listener is SASL_SSL with SCRAM-SHA-512 (users: [`Broker::add_scram_user`])
    /// and the StandardAuthorizer: a client there gets what ACLs grant it ([`Broker::acl`]), nothing
    /// by default. The PLAINTEXT listener stays for the rig's own clients (User:ANONYMOUS, a super
    /// user) and the broker's traffic to itself.
    pub fn start_sasl(server: &Issued) -> Broker {
        Broker::launch(Some((
            "SASL_SSL",
            server,
            "listener.name.sasl_ssl.sasl.enabled.mechanisms=SCRAM-SHA-512\n\
             listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=\
             org.apache.kafka.common.security.scram.ScramLoginModule required;\n\
             authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer\n\
             super.users=User:ANONYMOUS\n"
                .to_string(),
        )))
    }

    /// `secure`: the second listener's protocol, its certificate, and more properties. Ports are
    /// picked free and the JVM binds them seconds later: one taken meanwhile gets new ports.
    fn launch(secure: Option<(&str, &Issued, String)>) -> Broker {
        Broker::launch_with(secure, "")
    }

    fn launch_with(secure: Option<(&str, &Issued, String)>, properties: &str) -> Broker {
        Broker::launch_on("127.0.0.1", secure, properties)
    }

    fn launch_on(host: &str, secure: Option<(&str, &Issued, String)>, properties: &str) -> Broker {
        let mut attempt = 1;
        loop {
            match Broker::try_launch(host, secure.as_ref(), properties) {
                Ok(broker) => return broker,
                Err(log) if attempt < 3 && log.contains("Address already in use") => attempt += 1,
                Err(log) => panic!(
                    "Apache Kafka exited before it served (was it assembled? ./scripts/test.sh \
                     installs it):\n{log}"
                ),
            }
        }
    }

    /// One start; the log's tail when the broker exits before it serves.
    fn try_launch(
        host: &str,
        secure: Option<&(&str, &Issued, String)>,
        more: &str,
    ) -> Result<Broker, String> {
        let port = free_port();
        let controller = free_port();
        let dir = tempfile::Builder::new()
            .prefix("outboxd-kafka-")
            .tempdir()
            .unwrap();
        let mut listeners = format!("PLAINTEXT://{host}:{port}");
        let mut protocols = "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT".to_string();
        let mut extra = String::new();
        let mut tls_port = None;
        if let Some((protocol, server, more)) = secure {
            let secure_port = free_port();
            tls_port = Some(secure_port);
            listeners.push_str(&format!(",{protocol}://{host}:{secure_port}"));
            protocols.push_str(&format!(",{protocol}:{protocol}"));
            // Kafka reads a PEM keystore as one file: the key, then the certificate chain.
            let keystore = dir.path().join("keystore.pem");
            let pem = [
                std::fs::read_to_string(&server.key).unwrap(),
                std::fs::read_to_string(&server.cert).unwrap(),
            ]
            .concat();
            std::fs::write(&keystore, pem).unwrap();
            let name = protocol.to_ascii_lowercase();
            extra = format!(
                "listener.name.{name}.ssl.keystore.type=PEM\n\
                 listener.name.{name}.ssl.keystore.location={}\n{more}",
                keystore.display()
            );
        }
        let properties = dir.path().join("extra.properties");
        std::fs::write(
            &properties,
            format!(
                "listeners={listeners},CONTROLLER://127.0.0.1:{controller}\n\
                 advertised.listeners={listeners}\n\
                 listener.security.protocol.map={protocols}\n\
                 inter.broker.listener.name=PLAINTEXT\n{extra}\n{more}\n"
            ),
        )
        .unwrap();
        let broker_dir = dir.path().join("broker");
        let mut command = Command::new(script());
        command
            .arg("run")
            .arg(&broker_dir)
            .args([port.to_string(), controller.to_string()])
            .arg(&properties)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        small_jvm(&mut command);
        let mut child = command
            .spawn()
            .expect("start Apache Kafka through scripts/apache-kafka.sh");
        let log = broker_dir.join("server.log");
        let mut exited = false;
        wait_until("Apache Kafka to start", Duration::from_secs(90), || {
            exited = matches!(child.try_wait(), Ok(Some(_)));
            exited
                || (file_contains(&log, "Kafka Server started")
                    && TcpStream::connect((host, port)).is_ok())
        });
        if exited {
            let content = std::fs::read_to_string(&log).unwrap_or_default();
            let lines: Vec<&str> = content.lines().collect();
            return Err(lines[lines.len().saturating_sub(30)..].join("\n"));
        }
        Ok(Broker {
            port,
            tls_port,
            host: host.to_string(),
            child,
            _dir: dir,
        })
    }

    /// Creates (or changes) SCRAM-SHA-512 credentials for `user` (through Kafka's own ConfigCommand).
    pub fn add_scram_user(&self, user: &str, password: &str) {
        self.tool(
            "kafka.admin.ConfigCommand",
            &[
                "--alter",
                "--entity-type",
                "users",
                "--entity-name",
                user,
                "--add-config",
                &format!("SCRAM-SHA-512=[iterations=4096,password={password}]"),
            ],
        );
    }

    /// The `[kafka]` keys of a client that logs in on the SASL_SSL listener as `user` with SCRAM-SHA-512,
    /// trusting `ca`.
    pub fn sasl_client(&self, user: &str, password: &str, ca: &Path) -> String {
        format!(
            "brokers = \"{}\"\nproperties = {{ \"security.protocol\" = \"SASL_SSL\", \
             \"sasl.mechanism\" = \"SCRAM-SHA-512\", \"sasl.username\" = \"{user}\", \
             \"sasl.password\" = \"{password}\", \"ssl.ca.location\" = \"{}\" }}\n",
            self.tls_bootstrap(),
            ca.display()
        )
    }

    /// Kafka's own AclCommand with `args` (e.g. `--add --allow-principal User:x --operation Write
    /// --topic t`).
    pub fn acl(&self, args: &[&str]) {
        self.tool("org.apache.kafka.tools.AclCommand", args);
    }

    /// Runs one of Kafka's command-line tools against the PLAINTEXT listener.
    fn tool(&self, class: &str, args: &[&str]) {
        let out = self.tool_output(class, args);
        assert!(
            out.status.success(),
            "{class} {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// What one of Kafka's tools printed (e.g. `org.apache.kafka.tools.TransactionsCommand`), for
    /// diagnostics; its success is not checked.
    pub fn tool_output(&self, class: &str, args: &[&str]) -> std::process::Output {
        Command::new("java")
            .args(class_data_archive())
            .args(["-XX:TieredStopAtLevel=1", "-cp"])
            .arg(kafka_home().join("lib/*"))
            .arg(class)
            .args(["--bootstrap-server", &self.bootstrap()])
            .args(args)
            .output()
            .expect("java")
    }

    /// The broker process (signals; CPU accounting in the benchmark).
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGSTOP: the broker keeps its sockets but answers nothing (an outage as clients see it,
    /// without losing the records it holds).
    pub fn freeze(&self) {
        let pid = nix::unistd::Pid::from_raw(self.pid());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    }

    pub fn thaw(&self) {
        let pid = nix::unistd::Pid::from_raw(self.pid());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    }

    pub fn bootstrap(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// SIGKILL: the node gone, with no controlled shutdown, until [`Broker::resume`].
    pub fn kill9(&mut self) {
        self.thaw();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The broker's log directory (`log.dirs`): one folder per partition it holds.
    pub fn data_dir(&self) -> PathBuf {
        self._dir.path().join("broker").join("data")
    }

    /// The broker's logs, oldest first: one per run ([`Broker::resume`] keeps the one before).
    pub fn logs(&self) -> Vec<PathBuf> {
        let broker_dir = self._dir.path().join("broker");
        let mut logs: Vec<PathBuf> = (1..)
            .map(|n| broker_dir.join(format!("server.log.{n}")))
            .take_while(|path| path.exists())
            .collect();
        logs.push(broker_dir.join("server.log"));
        logs
    }

    /// The node [`Broker::kill9`] killed, again on its data and ports (`apache-kafka.sh resume`);
    /// waits until it serves.
    pub fn resume(&mut self) {
        let broker_dir = self._dir.path().join("broker");
        // The log of the run that ended stays (server.log.1, .2, …) for a failing test to read.
        let kept = (1..)
            .map(|n| broker_dir.join(format!("server.log.{n}")))
            .find(|path| !path.exists())
            .unwrap();
        let _ = std::fs::rename(broker_dir.join("server.log"), kept);
        let mut command = Command::new(script());
        command
            .arg("resume")
            .arg(&broker_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        small_jvm(&mut command);
        self.child = command.spawn().expect("resume Apache Kafka");
        let log = broker_dir.join("server.log");
        let (host, port) = (self.host.clone(), self.port);
        wait_until(
            "Apache Kafka to start again",
            Duration::from_secs(90),
            || {
                file_contains(&log, "Kafka Server started")
                    && TcpStream::connect((host.as_str(), port)).is_ok()
            },
        );
    }

    /// The SSL listener's address (panics on a broker without one).
    pub fn tls_bootstrap(&self) -> String {
        format!(
            "{}:{}",
            self.host,
            self.tls_port.expect("a broker started with TLS")
        )
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        // Not `thaw`: after `kill9` without `resume` the pid is gone.
        let pid = nix::unistd::Pid::from_raw(self.pid());
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
