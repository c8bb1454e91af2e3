//! Debezium, the incumbent: Kafka Connect standalone with Debezium's MariaDB or Postgres connector
//! and the Outbox Event Router, started through `scripts/debezium.sh run` (which the benchmark uses
//! too) on a free loopback port in a temp dir, and killed on drop, also on panic.
//!
//! Each [`Connector`] is one connector properties file; a worker may run several (each with its own
//! converters, as Connect allows per connector). Offsets go to the worker's standalone offsets file
//! ([`Connect::offsets_file`]), the file `outboxd checkpoint import-debezium` reads in a cutover.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, http_get, wait_until, Mysqld, Postgres};

/// Password of the `debezium` user the connectors log in as (it is no secret of outboxd's).
pub const PASSWORD: &str = "dbz-pass";

/// One connector: its name and properties (the `name` and `connector.class` included).
pub struct Connector {
    pub name: String,
    pub properties: Vec<(String, String)>,
}

impl Connector {
    /// Debezium's MariaDB connector on `db`'s `table`, with the Outbox Event Router routing to
    /// `<prefix>.${routedByValue}`. A `debezium` user with the grants Debezium documents is created.
    pub fn mariadb(name: &str, db: &Mysqld, server_id: u32, table: &str, prefix: &str) -> Self {
        db.sql_socket(&format!(
            "SET SESSION sql_log_bin = 0; CREATE USER IF NOT EXISTS 'debezium'@'127.0.0.1' IDENTIFIED BY '{PASSWORD}'; \
             GRANT SELECT, RELOAD, SHOW DATABASES, REPLICATION SLAVE, REPLICATION CLIENT, BINLOG MONITOR, LOCK TABLES \
             ON *.* TO 'debezium'@'127.0.0.1';"
        ));
        let dir = Connector::mariadb_history(db, name);
        Connector::new(
            name,
            &[
                (
                    "connector.class",
                    "io.debezium.connector.mariadb.MariaDbConnector",
                ),
                ("database.hostname", "127.0.0.1"),
                ("database.port", &db.port.to_string()),
                ("database.user", "debezium"),
                ("database.password", PASSWORD),
                ("database.server.id", &server_id.to_string()),
                ("topic.prefix", name),
                ("table.include.list", table),
                (
                    "schema.history.internal",
                    "io.debezium.storage.file.history.FileSchemaHistory",
                ),
                (
                    "schema.history.internal.file.filename",
                    &dir.display().to_string(),
                ),
                // Streaming only, as outboxd does by default (no initial snapshot of the table).
                ("snapshot.mode", "no_data"),
                ("include.schema.changes", "false"),
            ],
            prefix,
        )
    }

    /// Where [`Connector::mariadb`]'s schema history lives (a file beside the server's data).
    pub fn mariadb_history(db: &Mysqld, name: &str) -> PathBuf {
        db.dir().join(format!("debezium-{name}.history"))
    }

    /// Debezium's Postgres connector with `pgoutput` on database `app` of `pg`, creating (or
    /// reusing) `slot` and a publication `<slot>_publication` for `table` only.
    pub fn postgres(name: &str, pg: &Postgres, slot: &str, table: &str, prefix: &str) -> Self {
        pg.sql(
            "app",
            &format!(
                "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'debezium') THEN \
                 CREATE ROLE debezium WITH LOGIN REPLICATION PASSWORD '{PASSWORD}'; END IF; END $$; \
                 GRANT SELECT ON ALL TABLES IN SCHEMA public TO debezium; \
                 GRANT CREATE ON DATABASE app TO debezium; \
                 ALTER TABLE {table} OWNER TO debezium;"
            ),
        );
        Connector::new(
            name,
            &[
                (
                    "connector.class",
                    "io.debezium.connector.postgresql.PostgresConnector",
                ),
                ("database.hostname", "127.0.0.1"),
                ("database.port", &pg.port.to_string()),
                ("database.user", "debezium"),
                ("database.password", PASSWORD),
                ("database.dbname", "app"),
                ("topic.prefix", name),
                ("table.include.list", table),
                ("plugin.name", "pgoutput"),
                ("slot.name", slot),
                ("publication.name", &format!("{slot}_publication")),
                ("publication.autocreate.mode", "filtered"),
                ("snapshot.mode", "no_data"),
            ],
            prefix,
        )
    }

    fn new(name: &str, source: &[(&str, &str)], prefix: &str) -> Self {
        let mut properties: Vec<(String, String)> = vec![
            ("name".into(), name.into()),
            ("tasks.max".into(), "1".into()),
        ];
        properties.extend(source.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        properties.extend(
            [
                ("transforms", "outbox"),
                (
                    "transforms.outbox.type",
                    "io.debezium.transforms.outbox.EventRouter",
                ),
                (
                    "transforms.outbox.route.topic.replacement",
                    &format!("{prefix}.${{routedByValue}}"),
                ),
                // Debezium's keys and payloads as the raw column text (see `with`).
                (
                    "key.converter",
                    "org.apache.kafka.connect.storage.StringConverter",
                ),
                (
                    "value.converter",
                    "org.apache.kafka.connect.storage.StringConverter",
                ),
            ]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string())),
        );
        Connector {
            name: name.into(),
            properties,
        }
    }

    /// Sets (or replaces) a property, e.g. `transforms.outbox.table.fields.additional.placement`.
    pub fn with(mut self, key: &str, value: &str) -> Self {
        self.properties.retain(|(k, _)| k != key);
        self.properties.push((key.into(), value.into()));
        self
    }
}

pub struct Connect {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    connectors: Vec<String>,
    /// "Starting streaming" lines in the log before the running process began.
    streams_before: usize,
}

/// The script that assembles and runs Debezium (the one the benchmark calls too).
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/debezium.sh")
}

fn properties_text(properties: &[(String, String)]) -> String {
    properties
        .iter()
        .map(|(k, v)| format!("{k}={}\n", v.replace('\\', "\\\\")))
        .collect()
}

impl Connect {
    /// Starts a standalone worker on `bootstrap` with `connectors`, and waits until each one's task
    /// runs and has begun streaming (rows committed afterwards are read).
    pub fn start(bootstrap: &str, connectors: Vec<Connector>) -> Connect {
        Connect::start_with(bootstrap, connectors, &[])
    }

    /// [`Connect::start`] with more worker properties (e.g. `producer.linger.ms`).
    pub fn start_with(
        bootstrap: &str,
        connectors: Vec<Connector>,
        worker_extra: &[(&str, &str)],
    ) -> Connect {
        let dir = tempfile::Builder::new()
            .prefix("outboxd-debezium-")
            .tempdir()
            .unwrap();
        let mut connect = Connect {
            port: free_port(),
            child: None,
            dir,
            connectors: connectors.iter().map(|c| c.name.clone()).collect(),
            streams_before: 0,
        };
        let worker = [
            ("bootstrap.servers", bootstrap.to_string()),
            (
                "key.converter",
                "org.apache.kafka.connect.storage.StringConverter".into(),
            ),
            (
                "value.converter",
                "org.apache.kafka.connect.storage.StringConverter".into(),
            ),
            (
                "offset.storage.file.filename",
                connect.offsets_file().display().to_string(),
            ),
            // Connect's default is 60 s; a cutover test wants offsets that move while it runs.
            ("offset.flush.interval.ms", "1000".into()),
            ("listeners", format!("http://127.0.0.1:{}", connect.port)),
            ("plugin.discovery", "only_scan".into()),
        ]
        .map(|(k, v)| (k.to_string(), v))
        .into_iter()
        .chain(
            worker_extra
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string())),
        )
        .collect::<Vec<_>>();
        std::fs::write(
            connect.dir.path().join("worker.properties"),
            properties_text(&worker),
        )
        .unwrap();
        for c in &connectors {
            std::fs::write(
                connect.dir.path().join(format!("{}.properties", c.name)),
                properties_text(&c.properties),
            )
            .unwrap();
        }
        connect.launch();
        connect
    }

    /// How many times the log says a connector began streaming (its start position is fixed by
    /// then: rows committed afterwards are read; a task that merely runs may still be before it).
    fn streams_started(&self) -> usize {
        std::fs::read_to_string(self.log_path())
            .unwrap_or_default()
            .matches("ChangeEventSourceCoordinator Starting streaming")
            .count()
    }

    /// (Re)starts the worker process with the files written by [`Connect::start`], and waits
    /// until its connectors run and stream.
    pub fn launch(&mut self) {
        self.spawn();
        for name in self.connectors.clone() {
            let mut exited = false;
            wait_until(
                &format!("Debezium connector {name} to run"),
                Duration::from_secs(120),
                || {
                    exited = self.exited();
                    exited || self.task_running(&name)
                },
            );
            assert!(!exited, "Kafka Connect exited:\n{}", self.log_tail());
        }
        let mut exited = false;
        wait_until(
            "Debezium's connectors to start streaming",
            Duration::from_secs(120),
            || {
                exited = self.exited();
                exited || self.streaming()
            },
        );
        assert!(!exited, "Kafka Connect exited:\n{}", self.log_tail());
    }

    /// Starts the worker process and returns its pid (the JVM's: the script execs it).
    pub fn spawn(&mut self) -> i32 {
        assert!(self.child.is_none(), "the worker is running");
        self.streams_before = self.streams_started();
        let mut command = Command::new(script());
        command
            .arg("run")
            .arg(self.dir.path().join("worker.properties"))
            .args(
                self.connectors
                    .iter()
                    .map(|n| self.dir.path().join(format!("{n}.properties"))),
            )
            .env("DEBEZIUM_LOG", self.log_path())
            .stdout(Stdio::null())
            // The binlog client logs through java.util.logging, to stderr: kept beside the log.
            .stderr(std::fs::File::create(self.dir.path().join("connect.stderr")).unwrap());
        let child = command.spawn().expect("scripts/debezium.sh run");
        let pid = child.id() as i32;
        self.child = Some(child);
        pid
    }

    /// The running worker's pid (the JVM's; the benchmark reads its CPU time).
    #[allow(dead_code)]
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    /// Whether the process started last has exited.
    pub fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_none_or(|c| matches!(c.try_wait(), Ok(Some(_))))
    }

    /// Whether every connector of the running process has begun streaming.
    pub fn streaming(&self) -> bool {
        self.streams_started() >= self.streams_before + self.connectors.len()
    }

    fn task_running(&self, name: &str) -> bool {
        let (200, body) = http_get(self.port, &format!("/connectors/{name}/status")) else {
            return false;
        };
        let status: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        if status["tasks"][0]["state"] == "FAILED" {
            panic!(
                "Debezium connector {name} failed: {}\n{}",
                status["tasks"][0]["trace"],
                self.log_tail()
            );
        }
        status["tasks"][0]["state"] == "RUNNING"
    }

    /// Panics with the task's trace and the log's tail if a connector's task failed.
    pub fn assert_running(&self) {
        for name in &self.connectors {
            assert!(
                self.task_running(name),
                "Debezium connector {name} is not running:\n{}",
                self.log_tail()
            );
        }
    }

    /// Kafka Connect standalone's offsets file (a Java-serialised map of every connector's offset).
    pub fn offsets_file(&self) -> PathBuf {
        self.dir.path().join("offsets.dat")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("connect.log")
    }

    /// The log's last lines and the process's stderr (the script's own errors go there).
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let stderr =
            std::fs::read_to_string(self.dir.path().join("connect.stderr")).unwrap_or_default();
        let err: Vec<&str> = stderr.lines().collect();
        format!(
            "{}\n--- stderr ---\n{}",
            lines[lines.len().saturating_sub(40)..].join("\n"),
            err[err.len().saturating_sub(20)..].join("\n")
        )
    }

    /// Every connector offset in the offsets file: the JSON objects in Connect's Java-serialised
    /// map that are values (its keys are JSON arrays of the connector name and a partition
    /// object with `server`).
    pub fn offsets(&self) -> Vec<serde_json::Value> {
        let bytes = std::fs::read(self.offsets_file()).unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes);
        let mut found = Vec::new();
        let mut from = 0;
        while let Some(i) = text[from..].find('{') {
            let at = from + i;
            let mut stream =
                serde_json::Deserializer::from_str(&text[at..]).into_iter::<serde_json::Value>();
            match stream.next() {
                Some(Ok(v)) if v.is_object() => {
                    from = at + stream.byte_offset();
                    if v.get("server").is_none() {
                        found.push(v);
                    }
                }
                _ => from = at + 1,
            }
        }
        found
    }

    /// SIGTERM and wait: Connect stops its tasks and commits the offsets of what the producer
    /// acked. A worker that has not exited after 60 s is killed (and the test told so).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while child.try_wait().ok().flatten().is_none() {
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "Kafka Connect did not stop within 60 s of SIGTERM:\n{}",
                        self.log_tail()
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// A crash (SIGKILL) at a moment when the offsets file is whole: Connect rewrites it in place
    /// every flush, so the worker is paused (SIGSTOP) until the file holds `connectors` offsets,
    /// then killed. What it had sent past that offset is what a crash leaves behind.
    pub fn crash(&mut self) {
        let Some(child) = self.child.as_ref() else {
            return;
        };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        use nix::sys::signal::{kill, Signal};
        wait_until(
            "Connect's offsets file to be whole while the worker is paused",
            Duration::from_secs(60),
            || {
                let _ = kill(pid, Signal::SIGSTOP);
                if self.offsets().len() == self.connectors.len() {
                    return true;
                }
                let _ = kill(pid, Signal::SIGCONT);
                false
            },
        );
        self.kill();
    }

    /// SIGKILL: offsets stay as last flushed (at most `offset.flush.interval.ms` old).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Connect {
    fn drop(&mut self) {
        self.kill();
    }
}
