//! A private MariaDB with a ROW binlog.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, wait_until};

/// Password of the `cdc` user outboxd connects as (REPLICATION SLAVE, REPLICATION CLIENT, BINLOG MONITOR, SELECT).
pub const CDC_PASSWORD: &str = "cdc-s3cret";

pub struct MariaDb {
    dir: tempfile::TempDir,
    pub port: u16,
    child: Option<Child>,
}

impl MariaDb {
    /// Installs and starts a fresh server. `extra` lines go into `[mysqld]`.
    pub fn start(extra: &[&str]) -> MariaDb {
        let dir = tempfile::Builder::new()
            .prefix("outboxd-mariadb-")
            .tempdir()
            .unwrap();
        let port = free_port();
        let root = dir.path();
        let cnf = format!(
            "[mysqld]\ndatadir={d}/data\nport={port}\nbind-address=127.0.0.1\nsocket={d}/mysqld.sock\n\
             pid-file={d}/mysqld.pid\nlog-error={d}/error.log\nlog-bin={d}/data/mariadb-bin\n\
             tmpdir={d}/tmp\n\
             binlog-format=ROW\nbinlog-row-image=FULL\nserver-id=1\nuser=root\nskip-name-resolve\n\
             innodb-buffer-pool-size=64M\nmax-allowed-packet=64M\ninnodb-flush-log-at-trx-commit=2\n\
             sync-binlog=0\ninnodb-log-file-size=48M\n{extra}\n",
            d = root.display(),
            extra = extra.join("\n"),
        );
        std::fs::write(root.join("my.cnf"), cnf).unwrap();
        // A private tmpdir: servers bootstrapping side by side otherwise collide on temp table names.
        std::fs::create_dir(root.join("tmp")).unwrap();
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
        let mut db = MariaDb {
            dir,
            port,
            child: None,
        };
        db.boot();
        // Not binlogged: a replica built from this rig must hold no GTIDs of its own, or a reader
        // moving between replicas by GTID would ask for transactions only one of them has.
        db.sql_socket(&format!(
            "SET SESSION sql_log_bin = 0; CREATE USER IF NOT EXISTS 'root'@'127.0.0.1'; GRANT ALL ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION; \
             CREATE USER 'cdc'@'127.0.0.1' IDENTIFIED BY '{CDC_PASSWORD}'; \
             GRANT REPLICATION SLAVE, REPLICATION CLIENT, BINLOG MONITOR, SELECT ON *.* TO 'cdc'@'127.0.0.1';"
        ));
        db
    }

    /// Starts the server (again, after [`MariaDb::stop`]) and waits until it accepts connections.
    pub fn boot(&mut self) {
        let child = Command::new("/usr/sbin/mariadbd")
            .arg(format!(
                "--defaults-file={}",
                self.dir.path().join("my.cnf").display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mariadbd");
        self.child = Some(child);
        let socket = self.socket();
        // 120 s: a loaded 2-core machine once kept a fresh server from accepting for over 60.
        wait_until(
            "mariadbd to accept connections",
            Duration::from_secs(120),
            || {
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

    /// The binlog's current end (`SHOW MASTER STATUS`): file and position.
    pub fn binlog_end(&self) -> (String, u64) {
        let status = self.sql_socket("SHOW MASTER STATUS;");
        let mut cols = status.split('\t');
        let file = cols.next().unwrap().to_string();
        let pos = cols.next().unwrap().trim().parse().unwrap();
        (file, pos)
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

    /// [`MariaDb::stop`], saying whether the server ignored SIGTERM for 120 s and was killed
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
    pub fn start_replica(primary: &MariaDb, server_id: u32, extra: &[&str]) -> MariaDb {
        let id = format!("server-id={server_id}");
        let mut lines = vec![id.as_str()];
        lines.extend_from_slice(extra);
        let replica = MariaDb::start(&lines);
        let gtid = primary
            .sql_socket("SELECT @@gtid_binlog_pos;")
            .trim()
            .to_string();
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
    pub fn catch_up(&self, primary: &MariaDb) {
        let gtid = primary
            .sql_socket("SELECT @@gtid_binlog_pos;")
            .trim()
            .to_string();
        let waited = self.sql_socket(&format!("SELECT MASTER_GTID_WAIT('{gtid}', 120);"));
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

    /// SIGCONT after [`MariaDb::freeze`].
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

impl Drop for MariaDb {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
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
