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

use super::{free_port, http_get, wait_until, MariaDb, Postgres};

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
    pub fn mariadb(name: &str, db: &MariaDb, server_id: u32, table: &str, prefix: &str) -> Self {
        db.sql_socket(&format!(
            "SET SESSION sql_log_bin = 0; CREATE USER IF NOT EXISTS 'debezium'@'127.0.0.1' IDENTIFIED BY '{PASSWORD}'; \
             GRANT SELECT, RELOAD, SHOW DATABASES, REPLICATION SLAVE, REPLICATION CLIENT, BINLOG MONITOR, LOCK TABLES \
             ON *.* TO 'debezium'@'127.0.0.1';"
        ));
        let dir = db.dir().join(format!("debezium-{name}.history"));
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
        let dir = tempfile::Builder::new()
            .prefix("outboxd-debezium-")
            .tempdir()
            .unwrap();
        let mut connect = Connect {
            port: free_port(),
            child: None,
            dir,
            connectors: connectors.iter().map(|c| c.name.clone()).collect(),
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
        .map(|(k, v)| (k.to_string(), v));
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

    /// (Re)starts the worker process with the files written by [`Connect::start`].
    pub fn launch(&mut self) {
        assert!(self.child.is_none(), "the worker is running");
        let streams_before = self.streams_started();
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
        self.child = Some(command.spawn().expect("scripts/debezium.sh run"));
        for name in self.connectors.clone() {
            let mut exited = false;
            wait_until(
                &format!("Debezium connector {name} to run"),
                Duration::from_secs(120),
                || {
                    exited = matches!(self.child.as_mut().unwrap().try_wait(), Ok(Some(_)));
                    exited || self.task_running(&name)
                },
            );
            assert!(!exited, "Kafka Connect exited:\n{}", self.log_tail());
        }
        let wanted = streams_before + self.connectors.len();
        wait_until(
            "Debezium's connectors to start streaming",
            Duration::from_secs(120),
            || self.streams_started() >= wanted,
        );
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

    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// SIGTERM and wait: Connect stops its tasks and commits the offsets of what the producer acked.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let _ = child.wait();
        }
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
