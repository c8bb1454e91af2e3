//! The world a soak run breaks: a network namespace with outboxd inside, the database and the
//! broker (`sink`) outside on the veth's host address (MariaDB: a primary the load writes to and
//! two GTID replicas outboxd reads, as users run it), one outboxd (file checkpoint on a small
//! tmpfs; or exactly-once on Redis, checkpoint in Redis) or two (exactly-once on Kafka, Kafka
//! checkpoint store: a leader and a standby), and a supervisor that starts an instance again a
//! second after it exits, as systemd's `Restart=on-failure` would.
//!
//! The nemesis ([`World::inject`]) and the supervisor ([`World::tick`]) run on the caller's thread,
//! so a fault and a restart never race; the load and the checker's reader run on their own.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::{kill, Signal};

use super::operator::Operator;
use super::plan::{Kind, Step};
use super::sink::{Sink, SinkServer};
use crate::rig::disk::SmallDisk;
use crate::rig::mysqld::{try_sql_at, CDC_PASSWORD};
use crate::rig::netns::NetNs;
use crate::rig::{Mysqld, Outboxd, Postgres};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Mysqld,
    Postgres,
}

pub enum Db {
    Mysqld(Mysqld),
    Postgres(Arc<Postgres>),
}

/// One injected fault as it happened.
pub struct Injected {
    pub kind: Kind,
    pub started: Instant,
    pub ended: Instant,
    /// Wall-clock bounds (ms since the epoch), to compare with the broker's append times.
    pub started_ms: i64,
    pub ended_ms: i64,
    /// What exactly was done (which instance, how long, how much loss).
    pub detail: String,
    /// A rewind's restart (ms since the epoch): what it replays is appended from then on.
    pub restarted_ms: Option<i64>,
}

/// An outboxd exit nobody asked for, with the last error line of its log.
pub struct Exit {
    pub at: Instant,
    pub instance: usize,
    pub status: String,
    pub last_error: String,
}

struct Instance {
    outboxd: Outboxd,
    /// When to start it again (after an exit or a kill); `None` while it runs.
    restart_at: Option<Instant>,
}

pub struct World {
    pub sink: SinkServer,
    pub db: Db,
    /// MariaDB's two replicas outboxd reads (its URL lists both), empty for Postgres.
    replicas: Vec<Mysqld>,
    /// Declared after the servers: dropped (links and namespace deleted) once they are gone.
    pub ns: NetNs,
    /// The checkpoint directory's tmpfs (file store), filled by [`Kind::DiskFull`]; unmounted
    /// before the instances' directories are removed (fields drop in this order).
    disk: Option<SmallDisk>,
    instances: Vec<Instance>,
    pub peak_rss_kib: u64,
    pub exits: Vec<Exit>,
    pub starts: usize,
    /// Aborts a hanging Kafka transaction outboxd names, once `find-hanging` confirms it.
    pub operator: Operator,
}

fn epoch_ms() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The kinds of fault the world of `source` and `sink` takes: a leader to kill only beside a
/// standby (Kafka's checkpoint store, which exactly-once on Kafka needs; Redis's has no lead), a
/// disk to fill only under the file checkpoint, a replica to fail over from only on MariaDB.
pub fn kinds(source: Source, sink: Sink, exactly_once: bool) -> Vec<Kind> {
    let mut kinds = vec![
        Kind::Kill9,
        Kind::Pause,
        Kind::BrokerKill,
        Kind::BrokerFreeze,
        Kind::DbRestart,
        Kind::Partition,
        Kind::Loss,
        Kind::Slow,
        Kind::Rewind,
    ];
    if exactly_once && sink == Sink::Kafka {
        kinds.push(Kind::LeaderKill);
    }
    if !exactly_once {
        kinds.push(Kind::DiskFull);
    }
    if source == Source::Mysqld {
        kinds.push(Kind::ReplicaFailover);
    }
    kinds
}

impl World {
    pub fn setup(source: Source, sink: Sink, exactly_once: bool) -> World {
        let ns = NetNs::create();
        let host = ns.host_ip().to_string();
        let server = SinkServer::start_on(sink, &host);
        let mut replicas = Vec::new();
        let (db, source_section) = match source {
            Source::Mysqld => {
                let bind = format!("bind-address=127.0.0.1,{host}");
                let db = Mysqld::mariadb(&[&bind]);
                for server_id in [2, 3] {
                    let replica =
                        Mysqld::start_replica(&db, server_id, &["log-slave-updates=ON", &bind]);
                    // Not replicated (sql_log_bin = 0): a user of each replica's own.
                    replica.sql_socket(&format!(
                        "SET SESSION sql_log_bin = 0; \
                         CREATE USER 'cdc'@'{ip}' IDENTIFIED BY '{CDC_PASSWORD}'; \
                         GRANT REPLICATION SLAVE, REPLICATION CLIENT, BINLOG MONITOR, SELECT ON *.* TO 'cdc'@'{ip}';",
                        ip = ns.ns_ip()
                    ));
                    replicas.push(replica);
                }
                // Replicated: the replicas start from the primary's position before it.
                db.sql_socket(crate::rig::scenario::SCHEMA);
                for replica in &replicas {
                    replica.catch_up(&db);
                    assert!(
                        !replica
                            .sql_socket("SHOW TABLES FROM app LIKE 'outbox';")
                            .trim()
                            .is_empty(),
                        "a replica without app.outbox"
                    );
                }
                let hosts: Vec<String> = replicas
                    .iter()
                    .map(|r| format!("{host}:{}", r.port))
                    .collect();
                let section = format!(
                    "[source]\nkind = \"mysql\"\nurl = \"mysql://cdc@{}/app\"\ntables = [\"app.outbox\"]\n\
                     server_id = 99\n",
                    hosts.join(",")
                );
                (Db::Mysqld(db), section)
            }
            Source::Postgres => {
                let pg = Postgres::start(&[&format!("listen_addresses = '127.0.0.1,{host}'")]);
                let hba = format!(
                    "host all all {ip}/32 trust\nhost replication all {ip}/32 trust\n",
                    ip = ns.ns_ip()
                );
                let path = pg.dir().join("pg_hba.conf");
                let mut lines = std::fs::read_to_string(&path).unwrap();
                lines.push_str(&hba);
                std::fs::write(&path, lines).unwrap();
                pg.sql("postgres", "SELECT pg_reload_conf();");
                pg.sql("postgres", "CREATE DATABASE app;");
                pg.sql("app", crate::postgres_pipeline::SCHEMA);
                let section = format!(
                    "[source]\nkind = \"postgres\"\nurl = \"postgres://cdc@{host}:{}/app\"\n\
                     tables = [\"public.outbox\"]\nslot = \"outboxd_soak\"\npublication = \"outboxd_soak\"\n\
                     ",
                    pg.port
                );
                (Db::Postgres(Arc::new(pg)), section)
            }
        };
        let body = format!(
            "{source_section}{}[http]\nlisten = \"\"\n",
            server.section(&host, exactly_once)
        );
        // Exactly-once needs the sink's own checkpoint store; Kafka's also lets a standby stand by.
        let (count, checkpoint) = match (exactly_once, sink) {
            (true, Sink::Kafka) => (2, "store = \"kafka\"\ntakeover_timeout_ms = 3000\n"),
            (true, Sink::Redis) => (1, "store = \"redis\"\n"),
            (true, Sink::Nats | Sink::RabbitMq) => {
                panic!(
                    "--exactly-once: only Kafka and Redis have an exactly-once mode; drop the flag"
                )
            }
            (false, _) => (1, ""),
        };
        let instances: Vec<Instance> = (0..count)
            .map(|_| {
                let mut outboxd = Outboxd::with_checkpoint("soak", &body, checkpoint);
                outboxd.wrapper = ns.wrapper();
                Instance {
                    outboxd,
                    restart_at: None,
                }
            })
            .collect();
        let disk = (!exactly_once)
            .then(|| SmallDisk::mount(&instances[0].outboxd.dir_path().join("checkpoints"), "1m"));
        World {
            sink: server,
            db,
            replicas,
            ns,
            instances,
            disk,
            peak_rss_kib: 0,
            exits: Vec::new(),
            starts: 0,
            operator: Operator::default(),
        }
    }

    /// Starts every instance and waits until one streams.
    pub fn start(&mut self) {
        for i in 0..self.instances.len() {
            self.spawn(i);
        }
        let limit = Instant::now() + Duration::from_secs(90);
        while self.leader().is_none() {
            assert!(
                Instant::now() < limit,
                "no outboxd opened the stream within 90 s:\n{}",
                self.instances[0].outboxd.log()
            );
            self.tick();
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn spawn(&mut self, i: usize) {
        let instance = &mut self.instances[i];
        instance.outboxd.spawn(&[]);
        instance.restart_at = None;
        self.starts += 1;
    }

    /// The instance streaming now: the last of its log's "stream opened" / "standing by" lines is
    /// the first.
    pub fn leader(&self) -> Option<usize> {
        (0..self.instances.len()).find(|&i| {
            let instance = &self.instances[i];
            if !instance.outboxd.started() {
                return false;
            }
            let log = instance.outboxd.log();
            let opened = log.rfind("stream opened");
            opened.is_some() && opened > log.rfind("standing by")
        })
    }

    /// The supervisor: records exits, starts instances whose time came, samples peak RSS.
    pub fn tick(&mut self) {
        let now = Instant::now();
        for i in 0..self.instances.len() {
            let instance = &mut self.instances[i];
            if let Some(status) = instance.outboxd.exited() {
                let log = instance.outboxd.log();
                // outboxd's own last word on stderr, else its last ERROR line.
                let last_error = log
                    .lines()
                    .rev()
                    .find(|l| l.starts_with("outboxd:"))
                    .or_else(|| log.lines().rev().find(|l| l.contains("ERROR")))
                    .unwrap_or("")
                    .chars()
                    .take(300)
                    .collect();
                self.exits.push(Exit {
                    at: now,
                    instance: i,
                    status: status.to_string(),
                    last_error,
                });
                instance.restart_at = Some(now + Duration::from_secs(1));
            }
            let instance = &mut self.instances[i];
            if instance.outboxd.started() {
                let status = format!("/proc/{}/status", instance.outboxd.pid());
                if let Some(kib) = std::fs::read_to_string(status).ok().and_then(|s| {
                    s.lines()
                        .find(|l| l.starts_with("VmHWM:"))
                        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                }) {
                    self.peak_rss_kib = self.peak_rss_kib.max(kib);
                }
            } else if instance.restart_at.is_some_and(|at| at <= now) {
                self.spawn(i);
            }
        }
        if let Some(broker) = self.sink.kafka() {
            self.operator.look(
                broker,
                self.instances.iter().map(|instance| instance.outboxd.log()),
            );
        }
    }

    /// Supervises for `how_long`.
    pub fn idle(&mut self, how_long: Duration) {
        let until = Instant::now() + how_long;
        while Instant::now() < until {
            self.tick();
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// [`Kind::Rewind`]: saves the live checkpoint, lets the pipeline go on for `hold`, stops every
    /// instance, sets the checkpoint back to what was saved, and lets the supervisor start them.
    /// Returns what was done and when they were started again (`None`: not rewound).
    fn rewind(&mut self, hold: Duration) -> (String, Option<i64>) {
        let label = format!("soak-{}", epoch_ms());
        let (ok, text) =
            crate::operate::output(&self.instances[0].outboxd, &["checkpoint", "save", &label]);
        // "saved POSITION as LABEL (WHERE)"; a MariaDB position reads "FILE:POS gtid:STATE" (a
        // MariaDB GTID state resumes as a replica would; MySQL is not in the soak).
        let saved = text.lines().find_map(|l| {
            l.strip_prefix("saved ")?
                .split_once(" as ")
                .map(|(p, _)| p.to_string())
        });
        let Some(saved) = saved.filter(|_| ok) else {
            return (
                format!("not rewound: `checkpoint save` said {}", text.trim()),
                None,
            );
        };
        let position = saved
            .split_whitespace()
            .find(|part| part.starts_with("gtid:"))
            .unwrap_or_else(|| saved.split_whitespace().next().unwrap_or_default())
            .to_string();
        self.idle(hold);
        // An instance that exited by itself just now is the supervisor's (an exit), not stopped.
        self.tick();
        self.terminate_all("stopped for a rewind");
        // A stopped leader releases the lead at once; one whose release did not get through
        // counts as leading for two takeover timeouts (`set` says it is running until then), and
        // a broker fault a moment ago may still be passing.
        let set = Instant::now();
        let outcome = loop {
            let (ok, text) = crate::operate::output(
                &self.instances[0].outboxd,
                &["checkpoint", "set", &position],
            );
            if ok {
                break Ok(());
            }
            if set.elapsed() > Duration::from_secs(60) {
                break Err(text);
            }
            std::thread::sleep(Duration::from_secs(1));
        };
        // The copies `save` and `set` left (file store): a long run must not fill the small disk.
        if let Ok(entries) = std::fs::read_dir(
            self.instances[0]
                .outboxd
                .dir_path()
                .join("checkpoints/soak.saved"),
        ) {
            for entry in entries.flatten() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        let restarted = epoch_ms();
        for instance in &mut self.instances {
            instance.restart_at = Some(Instant::now());
        }
        self.tick();
        match outcome {
            Ok(()) => (
                format!("back to {position}, saved {hold:?} before"),
                Some(restarted),
            ),
            Err(text) => (
                format!(
                    "not rewound: `checkpoint set {position}` said {}",
                    text.trim()
                ),
                None,
            ),
        }
    }

    /// A running instance: `target` modulo those running (the first one when none runs).
    fn running(&self, target: usize) -> Option<usize> {
        let running: Vec<usize> = (0..self.instances.len())
            .filter(|&i| self.instances[i].outboxd.started())
            .collect();
        (!running.is_empty()).then(|| running[target % running.len()])
    }

    /// Injects `step`'s fault, holds it, heals it.
    pub fn inject(&mut self, step: &Step) -> Injected {
        let started = Instant::now();
        let started_ms = epoch_ms();
        let hold = step.hold;
        let mut restarted_ms = None;
        let detail = match step.kind {
            Kind::Kill9 | Kind::LeaderKill => {
                let victim = if step.kind == Kind::LeaderKill {
                    self.leader().or_else(|| self.running(step.target))
                } else {
                    self.running(step.target)
                };
                match victim {
                    Some(i) => {
                        self.instances[i].outboxd.kill9();
                        self.instances[i].restart_at = Some(Instant::now() + hold);
                        self.idle(hold);
                        format!("instance {i}, restarted after {hold:?}")
                    }
                    None => "no instance was running".to_string(),
                }
            }
            Kind::Pause => match self.running(step.target) {
                Some(i) => {
                    let pid = self.instances[i].outboxd.pid();
                    kill(pid, Signal::SIGSTOP).unwrap();
                    self.idle(hold);
                    let _ = kill(pid, Signal::SIGCONT);
                    format!("instance {i} for {hold:?}")
                }
                None => "no instance was running".to_string(),
            },
            Kind::BrokerKill => {
                self.sink.kill9();
                self.idle(hold);
                self.sink.restart();
                format!("down {hold:?}")
            }
            Kind::BrokerFreeze => {
                self.sink.freeze();
                self.idle(hold);
                self.sink.thaw();
                format!("{hold:?}")
            }
            Kind::DbRestart => {
                // On MariaDB every server: outboxd has no source to move to for the hold.
                let mut killed = Vec::new();
                for (n, replica) in self.replicas.iter_mut().enumerate() {
                    if replica.stop_forced() {
                        killed.push(format!("R{}", n + 1));
                    }
                }
                match &mut self.db {
                    Db::Mysqld(db) => {
                        if db.stop_forced() {
                            killed.push("the primary".to_string());
                        }
                    }
                    Db::Postgres(pg) => pg.stop_fast(),
                }
                self.idle(hold);
                match &mut self.db {
                    Db::Mysqld(db) => db.boot(),
                    Db::Postgres(pg) => pg.start_again(),
                }
                for replica in &mut self.replicas {
                    replica.boot();
                }
                match killed.is_empty() {
                    true => format!("down {hold:?}"),
                    false => format!(
                        "down {hold:?}; {} ignored SIGTERM for 120 s and was killed",
                        killed.join(", ")
                    ),
                }
            }
            Kind::ReplicaFailover => self.replica_failover(step, hold),
            Kind::Partition => {
                self.ns.partition(true);
                self.idle(hold);
                self.ns.heal();
                format!("{hold:?}")
            }
            Kind::Loss => {
                self.ns.loss(step.percent);
                self.idle(hold);
                self.ns.heal();
                format!("{} % for {hold:?}", step.percent)
            }
            Kind::Slow => {
                self.ns.slow(200, 512);
                self.idle(hold);
                self.ns.heal();
                format!("{hold:?}")
            }
            Kind::DiskFull => {
                self.disk
                    .as_ref()
                    .expect("a file checkpoint on a tmpfs")
                    .fill();
                self.idle(hold);
                self.disk.as_ref().unwrap().free();
                format!("{hold:?}")
            }
            Kind::Rewind => {
                let (detail, restarted) = self.rewind(hold);
                restarted_ms = restarted;
                detail
            }
        };
        Injected {
            kind: step.kind,
            started,
            ended: Instant::now(),
            started_ms,
            ended_ms: epoch_ms(),
            restarted_ms,
            detail,
        }
    }

    /// [`Kind::ReplicaFailover`]: stops the replica outboxd streams from (else the one `step`
    /// aims at), holds, starts it again; says whether outboxd had moved to the other by then.
    fn replica_failover(&mut self, step: &Step, hold: Duration) -> String {
        let reading = self.replica_read();
        let r = reading.unwrap_or(step.target % self.replicas.len());
        self.replicas[r].stop();
        self.idle(hold);
        let moved = self.replica_read().filter(|&now| now != r);
        self.replicas[r].boot();
        let which = if reading.is_some() {
            "the one outboxd read"
        } else {
            "outboxd streamed from neither"
        };
        let outcome = match moved {
            Some(other) => format!("outboxd moved to R{}", other + 1),
            None => "outboxd had not moved by then".to_string(),
        };
        format!("replica R{} ({which}) down {hold:?}; {outcome}", r + 1)
    }

    /// The replica the streaming instance opened its last binlog stream on (its log names the
    /// server by address; a dump thread on the server may outlive the connection it served).
    fn replica_read(&self) -> Option<usize> {
        let log = self.instances[self.leader()?].outboxd.log();
        let opened = log
            .lines()
            .rev()
            .find(|l| l.contains("binlog stream opened"))?;
        self.replicas
            .iter()
            .position(|r| opened.contains(&format!(":{}/", r.port)))
    }

    /// Supervises until `done` holds or `limit` passes; whether it held.
    pub fn idle_until(&mut self, limit: Duration, mut done: impl FnMut() -> bool) -> bool {
        let until = Instant::now() + limit;
        loop {
            if done() {
                return true;
            }
            if Instant::now() > until {
                return false;
            }
            self.idle(Duration::from_millis(200));
        }
    }

    /// SIGTERM to every running instance, at the end of the run.
    pub fn stop(&mut self) {
        self.terminate_all("stopped at the end of the run");
    }

    /// SIGTERM to every running instance, and no restarts. One the supervisor started a moment
    /// ago may not handle SIGTERM yet, and a leader whose last commit fails exits non-zero: each
    /// is an exit, recorded with `why` (the report shows it), not a failed run (an hour's verdict
    /// was once thrown away that way).
    fn terminate_all(&mut self, why: &str) {
        let now = Instant::now();
        for (i, instance) in self.instances.iter_mut().enumerate() {
            instance.restart_at = None;
            if !instance.outboxd.started() {
                continue;
            }
            let status = instance.outboxd.terminate();
            if !status.success() {
                self.exits.push(Exit {
                    at: now,
                    instance: i,
                    status: status.to_string(),
                    last_error: why.into(),
                });
            }
        }
    }

    /// Every row id the database holds: the truth the checker compares against.
    pub fn committed_ids(&self) -> Vec<u128> {
        let text = match &self.db {
            Db::Mysqld(db) => db.sql_socket("SELECT HEX(id) FROM app.outbox;"),
            Db::Postgres(pg) => pg.sql(
                "app",
                "SELECT replace(id::text, '-', '') FROM public.outbox;",
            ),
        };
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(|l| u128::from_str_radix(l, 16).unwrap())
            .collect()
    }

    /// Runs one script on the database, for the load (through the local socket: the load's path is
    /// never faulted).
    pub fn exec(&self) -> super::load::Exec {
        match &self.db {
            Db::Mysqld(db) => {
                let socket = db.socket_path();
                Arc::new(move |sql: &str| try_sql_at(&socket, sql))
            }
            Db::Postgres(pg) => {
                let pg = pg.clone();
                Arc::new(move |sql: &str| pg.try_sql("app", sql))
            }
        }
    }

    /// Copies every log of every instance into `dir` (`instance-I-run-N.log`), the database's, and
    /// what Kafka's own tool says of the open transactions (`kafka-transactions.txt`).
    pub fn save_logs(&self, dir: &std::path::Path) {
        std::fs::create_dir_all(dir).unwrap();
        if let Some(broker) = self.sink.kafka() {
            std::fs::write(
                dir.join("kafka-transactions.txt"),
                super::operator::transactions_view(broker),
            )
            .unwrap();
            std::fs::write(dir.join("operator.txt"), &self.operator.transcript).unwrap();
        }
        self.sink.save_logs(dir);
        let server_log = match &self.db {
            Db::Mysqld(db) => db.dir().join("error.log"),
            Db::Postgres(pg) => pg.dir().join("postgres.log"),
        };
        let _ = std::fs::copy(server_log, dir.join("database.log"));
        for (r, replica) in self.replicas.iter().enumerate() {
            let _ = std::fs::copy(
                replica.dir().join("error.log"),
                dir.join(format!("database-r{}.log", r + 1)),
            );
        }
        for (i, instance) in self.instances.iter().enumerate() {
            for entry in std::fs::read_dir(instance.outboxd.dir_path())
                .unwrap()
                .flatten()
            {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with("run-") && name.ends_with(".log") {
                    let _ = std::fs::copy(entry.path(), dir.join(format!("instance-{i}-{name}")));
                }
            }
        }
    }

    /// The last lines of each instance's current log (for a failing run's message).
    pub fn log_tails(&self) -> String {
        self.instances
            .iter()
            .enumerate()
            .map(|(i, instance)| {
                let log = instance.outboxd.log();
                let lines: Vec<&str> = log.lines().collect();
                format!(
                    "--- instance {i} ---\n{}",
                    lines[lines.len().saturating_sub(25)..].join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for World {
    /// After a panic too: every instance is killed before the fields drop, since one still
    /// running would keep the checkpoint's tmpfs busy and its unmount would fail.
    fn drop(&mut self) {
        for instance in &mut self.instances {
            instance.outboxd.kill_if_running();
        }
        self.ns.heal();
    }
}
