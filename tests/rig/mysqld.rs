//! A private MySQL-protocol server with a ROW binlog: MariaDB 10.11 (Debian's package) or Oracle
//! MySQL 9 (Debian's unstable suite, in a private root by `scripts/mysql-9.sh`). Tests that hold
//! for both take a [`Flavor`] and run once per server ([`crate::on_both_servers`]).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, wait_until};

/// Password of the `cdc` user outboxd connects as (REPLICATION SLAVE, REPLICATION CLIENT, SELECT,
/// and MariaDB's BINLOG MONITOR).
pub const CDC_PASSWORD: &str = "cdc-s3cret";

/// Which server a test runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    MariaDb,
    MySql,
}

impl Flavor {
    /// Whether this server can run here: MariaDB always (the package is a hard dependency of the
    /// suite); MySQL 9 when `scripts/mysql-9.sh install` unpacked it. Err(reason) when its
    /// installer could not reach Debian's unstable suite: the test then skips and says so on the
    /// terminal (not in captured output). Panics when the installer never ran, so a machine
    /// set up by hand cannot pass by skipping.
    pub fn available(self) -> Result<(), String> {
        if self == Flavor::MariaDb || mysql_home().join(".complete").exists() {
            return Ok(());
        }
        let marker = mysql_home().with_extension("unavailable");
        match std::fs::read_to_string(&marker) {
            Ok(reason) => Err(format!("MySQL 9 could not be installed: {}", reason.trim())),
            Err(_) => panic!(
                "MySQL 9 is not installed in {}: run scripts/install-test-deps.sh (.ci/run does)",
                mysql_home().display()
            ),
        }
    }
}

/// Prints a skipped test on the terminal itself: `cargo test` captures `eprintln!`, not stderr.
pub fn skip(test: &str, why: &str) {
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// Where `scripts/mysql-9.sh` keeps MySQL 9 (the same cache the other servers use).
fn mysql_home() -> PathBuf {
    // Empty counts as unset, as in the scripts' ${OUTBOXD_TEST_CACHE:-…}.
    let cache = std::env::var_os("OUTBOXD_TEST_CACHE")
        .filter(|c| !c.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/outboxd-test")
        });
    cache.join("mysql-9")
}

fn mysql_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/mysql-9.sh")
}

pub struct Mysqld {
    dir: tempfile::TempDir,
    pub port: u16,
    pub flavor: Flavor,
    child: Option<Child>,
}

impl Mysqld {
    /// A fresh MariaDB. `extra` lines go into `[mysqld]`.
    pub fn mariadb(extra: &[&str]) -> Mysqld {
        Mysqld::start(Flavor::MariaDb, extra)
    }

    /// A fresh server of `flavor` (check [`Flavor::available`] first). `extra` lines go into
    /// `[mysqld]`, after the rig's own, so they override them.
    pub fn start(flavor: Flavor, extra: &[&str]) -> Mysqld {
        let dir = tempfile::Builder::new()
            .prefix(match flavor {
                Flavor::MariaDb => "outboxd-mariadb-",
                Flavor::MySql => "outboxd-mysql-",
            })
            .tempdir()
            .unwrap();
        let port = free_port();
        let root = dir.path();
        let common = format!(
            "[mysqld]\ndatadir={d}/data\nport={port}\nbind-address=127.0.0.1\nsocket={d}/mysqld.sock\n\
             pid-file={d}/mysqld.pid\nlog-error={d}/error.log\ntmpdir={d}/tmp\n\
             binlog-format=ROW\nbinlog-row-image=FULL\nserver-id=1\nuser=root\nskip-name-resolve\n\
             max-allowed-packet=64M\ninnodb-flush-log-at-trx-commit=2\nsync-binlog=0\n",
            d = root.display(),
        );
        let own = match flavor {
            Flavor::MariaDb => format!(
                "log-bin={d}/data/mariadb-bin\ninnodb-buffer-pool-size=64M\ninnodb-log-file-size=48M\n",
                d = root.display()
            ),
            // Small memory: ~290 MB RSS instead of ~540 at MySQL's defaults.
            Flavor::MySql => {
                let my = mysql_home().join("root");
                format!(
                    "log-bin={d}/data/mysql-bin\ngtid-mode=ON\nenforce-gtid-consistency=ON\n\
                     basedir={r}/usr\nlc-messages-dir={r}/usr/share/mysql\nplugin-dir={r}/usr/lib/mysql/plugin\n\
                     secure-file-priv={d}/tmp\nmysqlx=OFF\nperformance-schema=OFF\n\
                     innodb-buffer-pool-size=32M\ninnodb-redo-log-capacity=8M\n",
                    d = root.display(),
                    r = my.display()
                )
            }
        };
        std::fs::write(
            root.join("my.cnf"),
            format!("{common}{own}{}\n", extra.join("\n")),
        )
        .unwrap();
        // A private tmpdir: servers bootstrapping side by side otherwise collide on temp table names.
        std::fs::create_dir(root.join("tmp")).unwrap();
        match flavor {
            Flavor::MariaDb => install_mariadb(root),
            Flavor::MySql => copy_mysql_template(root),
        }
        let mut db = Mysqld {
            dir,
            port,
            flavor,
            child: None,
        };
        db.boot();
        let monitor = match flavor {
            Flavor::MariaDb => ", BINLOG MONITOR",
            Flavor::MySql => "",
        };
        // Not binlogged: a replica built from this rig must hold no GTIDs of its own, or a reader
        // moving between replicas by GTID would ask for transactions only one of them has.
        db.sql_socket(&format!(
            "SET SESSION sql_log_bin = 0; CREATE USER IF NOT EXISTS 'root'@'127.0.0.1'; GRANT ALL ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION; \
             CREATE USER 'cdc'@'127.0.0.1' IDENTIFIED BY '{CDC_PASSWORD}'; \
             GRANT REPLICATION SLAVE, REPLICATION CLIENT{monitor}, SELECT ON *.* TO 'cdc'@'127.0.0.1';"
        ));
        db
    }

    /// Starts the server (again, after [`Mysqld::stop`]) and waits until it accepts connections.
    pub fn boot(&mut self) {
        let defaults = format!(
            "--defaults-file={}",
            self.dir.path().join("my.cnf").display()
        );
        // The script execs the loader, which runs mysqld in the same process: the child is the server.
        let mut command = match self.flavor {
            Flavor::MariaDb => Command::new("/usr/sbin/mariadbd"),
            Flavor::MySql => {
                let mut c = Command::new(mysql_script());
                c.arg("mysqld");
                c
            }
        };
        let child = command
            .arg(defaults)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mariadbd / scripts/mysql-9.sh mysqld");
        self.child = Some(child);
        let socket = self.socket();
        // 120 s: a loaded 2-core machine once kept a fresh server from accepting for over 60.
        let error_log = self.dir.path().join("error.log");
        let child = self.child.as_mut().unwrap();
        wait_until(
            "the server to accept connections",
            Duration::from_secs(120),
            || {
                // A server that exits (a bad option, a port taken) says why in its error log.
                if let Ok(Some(status)) = child.try_wait() {
                    panic!(
                        "the server exited with {status} before accepting connections:\n{}",
                        std::fs::read_to_string(&error_log).unwrap_or_default()
                    );
                }
                Command::new("mariadb")
                    .arg(format!("--socket={}", socket.display()))
                    .args(["-uroot", "-e", "select 1"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            },
        );
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("mysqld.sock")
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The binlog's current end (`SHOW MASTER STATUS`, MySQL 9: `SHOW BINARY LOG STATUS`): file
    /// and position.
    pub fn binlog_end(&self) -> (String, u64) {
        let status = self.sql_socket(match self.flavor {
            Flavor::MariaDb => "SHOW MASTER STATUS;",
            Flavor::MySql => "SHOW BINARY LOG STATUS;",
        });
        let mut cols = status.split('\t');
        let file = cols.next().unwrap().to_string();
        let pos = cols.next().unwrap().trim().parse().unwrap();
        (file, pos)
    }

    /// The server's GTID state as outboxd writes it into a checkpoint: MariaDB's
    /// `@@gtid_binlog_pos`, MySQL's `@@gtid_executed` (one line, as the server prints it).
    pub fn gtid(&self) -> String {
        let sql = match self.flavor {
            Flavor::MariaDb => "SELECT @@gtid_binlog_pos;",
            Flavor::MySql => "SELECT @@gtid_executed;",
        };
        // The client prints a newline inside a value as \n.
        self.sql_socket(sql).trim().replace("\\n", "")
    }

    /// Runs SQL through the admin socket with the `mariadb` client; returns its tab-separated output.
    pub fn sql_socket(&self, sql: &str) -> String {
        sql_at(&self.socket(), sql)
    }

    pub fn socket_path(&self) -> PathBuf {
        self.socket()
    }

    /// URL for outboxd (password supplied separately through the environment).
    pub fn cdc_url(&self) -> String {
        format!("mysql://cdc@127.0.0.1:{}/app", self.port)
    }

    /// Stops the server cleanly (SIGTERM) and waits for it to exit; SIGKILL after two minutes (a
    /// shutdown that hangs must not stall a long run).
    pub fn stop(&mut self) {
        self.stop_forced();
    }

    /// [`Mysqld::stop`], saying whether the server ignored SIGTERM for 120 s and was killed
    /// (a crash, not a clean restart: the fault schedule reports it).
    pub fn stop_forced(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return false;
        };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let limit = std::time::Instant::now() + Duration::from_secs(120);
        while std::time::Instant::now() < limit {
            if child.try_wait().ok().flatten().is_some() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        true
    }

    /// A GTID replica of `primary` (`server-id` = `server_id`), replicating from the primary's
    /// current position. `extra` goes into its `[mysqld]`.
    pub fn start_replica(primary: &Mysqld, server_id: u32, extra: &[&str]) -> Mysqld {
        let id = format!("server-id={server_id}");
        let mut lines = vec![id.as_str()];
        lines.extend_from_slice(extra);
        let replica = Mysqld::start(primary.flavor, &lines);
        let gtid = primary.gtid();
        if primary.flavor == Flavor::MySql {
            // What the primary executed so far counts as applied here: replication starts at its
            // current position, as MariaDB's gtid_slave_pos does below.
            replica.sql_socket(&format!(
                "RESET BINARY LOGS AND GTIDS; SET GLOBAL gtid_purged = '{gtid}';
                 CHANGE REPLICATION SOURCE TO SOURCE_HOST='127.0.0.1', SOURCE_PORT={},
                   SOURCE_USER='cdc', SOURCE_PASSWORD='{CDC_PASSWORD}', SOURCE_AUTO_POSITION=1,
                   GET_SOURCE_PUBLIC_KEY=1, SOURCE_CONNECT_RETRY=1;
                 START REPLICA;",
                primary.port
            ));
            return replica;
        }
        replica.sql_socket(&format!(
            "SET GLOBAL gtid_slave_pos = '{gtid}';
             CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT={}, MASTER_USER='cdc',
               MASTER_PASSWORD='{CDC_PASSWORD}', MASTER_USE_GTID=slave_pos, MASTER_CONNECT_RETRY=1;
             START SLAVE;",
            primary.port
        ));
        replica
    }

    /// Waits until this replica applied everything `primary` has committed so far.
    pub fn catch_up(&self, primary: &Mysqld) {
        let gtid = primary.gtid();
        let waited = self.sql_socket(&match self.flavor {
            Flavor::MariaDb => format!("SELECT MASTER_GTID_WAIT('{gtid}', 120);"),
            Flavor::MySql => format!("SELECT WAIT_FOR_EXECUTED_GTID_SET('{gtid}', 120);"),
        });
        assert_eq!(waited.trim(), "0", "replica did not catch up with {gtid}");
    }

    /// The server process (signals; CPU accounting in the benchmark).
    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }

    /// SIGSTOP: the server keeps its sockets open but says nothing (a hung server or a dead path).
    pub fn freeze(&self) {
        let pid = nix::unistd::Pid::from_raw(self.pid());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    }

    /// SIGCONT after [`Mysqld::freeze`].
    pub fn thaw(&self) {
        let pid = nix::unistd::Pid::from_raw(self.pid());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    }

    /// Starts the stopped server again on the same port and data.
    pub fn restart(&mut self) {
        self.stop();
        self.boot();
    }
}

impl Drop for Mysqld {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn install_mariadb(root: &Path) {
    let out = Command::new("mariadb-install-db")
        .arg(format!("--defaults-file={}", root.join("my.cnf").display()))
        .args([
            "--user=root",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
        ])
        .output()
        .expect("mariadb-install-db (apt-get install mariadb-server; .ci/run does it)");
    assert!(
        out.status.success(),
        "mariadb-install-db failed: {}{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(root.join("error.log")).unwrap_or_default()
    );
}

/// MySQL's data directory, copied from the one `scripts/mysql-9.sh install` initialized (3-6 s
/// saved per server); without its auto.cnf, so each copy gets a server_uuid of its own.
fn copy_mysql_template(root: &Path) {
    let template = mysql_home().join("template/data");
    let out = Command::new("cp")
        .arg("-a")
        .arg(&template)
        .arg(root.join("data"))
        .output()
        .expect("cp");
    assert!(
        out.status.success(),
        "copying {} failed: {}",
        template.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `sql` (fed on stdin, so it may be long) as root through the server's socket.
pub fn sql_at(socket: &Path, sql: &str) -> String {
    try_sql_at(socket, sql)
        .unwrap_or_else(|stderr| panic!("SQL failed: {}\n{stderr}", &sql[..sql.len().min(300)]))
}

/// [`sql_at`] that returns the client's stderr instead of panicking (a load that outlives a restart).
pub fn try_sql_at(socket: &Path, sql: &str) -> Result<String, String> {
    let mut child = Command::new("mariadb")
        .arg(format!("--socket={}", socket.display()))
        // No reconnect: a script cut off mid-transaction must not go on in a new session.
        .args([
            "-uroot",
            "-N",
            "-B",
            "--skip-reconnect",
            "--default-character-set=utf8mb4",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A failing statement makes the client exit early; its stderr (below) says why.
    let _ = child.stdin.take().unwrap().write_all(sql.as_bytes());
    let out = child.wait_with_output().unwrap();
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}
