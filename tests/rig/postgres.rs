//! A private PostgreSQL with `wal_level=logical`: Debian's 15 by default, or another major
//! ([`Postgres::start_major`]) from the binaries `scripts/postgres-majors.sh` unpacks into the test
//! cache. The client tools (psql, pg_isready) are always Debian 15's.
//!
//! initdb refuses root, so when the tests run as root the data directory belongs to the `postgres` OS
//! user and the server commands (`initdb`, `pg_ctl`) run through `runuser -u postgres`. `psql` runs as
//! the test's own user: trust authentication lets it in as the `postgres` role through the unix socket.
//! The temp dir is the data directory and also holds the unix socket and the server log.
//!
//! For speed the server runs with `fsync=off` and `full_page_writes=off`: safe against a process crash
//! ([`Postgres::crash_restart`]), as the OS keeps what was written. `synchronous_commit` stays `on`:
//! with `off` a commit acknowledged up to ~200 ms before an immediate stop is lost (measured), which
//! would make "the row survived the crash" assertions flaky. Pass it in `extra` where that is fine.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use super::{free_port, wait_until};

/// Where the Debian `postgresql-15` package puts the server binaries (and the client tools every
/// major is driven with).
pub const BIN: &str = "/usr/lib/postgresql/15/bin";

/// The majors the rig runs besides 15 (`scripts/postgres-majors.sh list`).
pub const MAJORS: [u32; 5] = [13, 14, 16, 17, 18];

/// The server binaries' directory for `major`. Others than 15 live in the test cache, which is
/// under root's home when the tests run as root: the `postgres` OS user cannot reach it there, so
/// the tree is copied once to a directory of its own under the system temp dir (named by the
/// unpacked version; kept for later runs).
fn server_bin(major: u32) -> PathBuf {
    if major == 15 {
        return PathBuf::from(BIN);
    }
    let cache = std::env::var_os("OUTBOXD_TEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/outboxd-test")
        });
    let home = cache.join(format!("postgres-{major}"));
    let version = std::fs::read_to_string(home.join(".complete")).unwrap_or_else(|_| {
        panic!(
            "PostgreSQL {major} is not installed in {} (scripts/install-test-deps.sh runs scripts/postgres-majors.sh install)",
            home.display()
        )
    });
    if !as_root() {
        return home.join("bin");
    }
    static COPY: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = COPY.lock().unwrap_or_else(|e| e.into_inner());
    let copy = std::env::temp_dir().join(format!("outboxd-test-postgres-{}", version.trim()));
    if !copy.join(".complete").exists() {
        let partial = copy.with_extension(format!("partial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&partial);
        let out = Command::new("cp")
            .arg("-a")
            .arg(&home)
            .arg(&partial)
            .output()
            .expect("cp");
        assert!(out.status.success(), "copying {}: {out:?}", home.display());
        std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o755)).unwrap();
        let _ = std::fs::remove_dir_all(&copy);
        std::fs::rename(&partial, &copy).unwrap();
    }
    copy.join("bin")
}

/// The OS user (and superuser role) the server runs as.
const OS_USER: &str = "postgres";

pub struct Postgres {
    dir: tempfile::TempDir,
    pub port: u16,
    log: PathBuf,
    /// The server binaries' directory.
    bin: PathBuf,
}

impl Postgres {
    /// initdb + start of Debian's 15; `extra` lines are appended to postgresql.conf.
    pub fn start(extra: &[&str]) -> Postgres {
        Postgres::start_major(15, extra)
    }

    /// [`Postgres::start`] of PostgreSQL `major` (15 or one of [`MAJORS`]).
    pub fn start_major(major: u32, extra: &[&str]) -> Postgres {
        let bin = server_bin(major);
        let dir = tempfile::Builder::new()
            .prefix("outboxd-postgres-")
            .tempdir()
            .unwrap();
        let root = dir.path();
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700)).unwrap();
        if as_root() {
            let user = nix::unistd::User::from_name(OS_USER)
                .unwrap()
                .expect("a `postgres` OS user (apt-get install postgresql-15; scripts/install-test-deps.sh does it)");
            nix::unistd::chown(root, Some(user.uid), Some(user.gid)).unwrap();
        }
        let port = free_port();
        let pg = Postgres {
            log: root.join("postgres.log"),
            dir,
            port,
            bin,
        };
        let out = pg
            .server_command("initdb")
            .arg("-D")
            .arg(pg.dir())
            .args([
                "-U",
                OS_USER,
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
            ])
            .output()
            .expect("initdb (apt-get install postgresql-15; scripts/install-test-deps.sh does it)");
        assert!(
            out.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // postgresql.conf now belongs to the postgres user; root may append to it all the same.
        let conf = format!(
            "\n# outboxd test rig\nlisten_addresses='127.0.0.1'\nport={port}\nunix_socket_directories='{d}'\n\
             wal_level=logical\nmax_replication_slots=10\nmax_wal_senders=10\n\
             fsync=off\nfull_page_writes=off\n{extra}\n",
            d = pg.dir().display(),
            extra = extra.join("\n"),
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(pg.dir().join("postgresql.conf"))
            .unwrap()
            .write_all(conf.as_bytes())
            .unwrap();
        pg.pg_ctl(&["-w", "start"]);
        pg.wait_ready();
        pg
    }

    /// Turns TLS on with `cert`/`key` (copied into the data directory, owned by the server's user,
    /// mode 0600) and `ca` for client certificates; `hba` lines go first in pg_hba.conf. Reloads.
    pub fn enable_tls(&self, cert: &Path, key: &Path, ca: &Path, hba: &[&str]) {
        self.install_tls_files(cert, key, ca);
        let path = self.dir().join("pg_hba.conf");
        let old = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, format!("{}\n{old}", hba.join("\n"))).unwrap();
        self.sql(
            "postgres",
            "ALTER SYSTEM SET ssl = on; ALTER SYSTEM SET ssl_cert_file = 'tls-server.pem'; \
             ALTER SYSTEM SET ssl_key_file = 'tls-server.key'; ALTER SYSTEM SET ssl_ca_file = 'tls-ca.pem'; \
             SELECT pg_reload_conf();",
        );
        self.wait_for_tls(true);
    }

    /// Replaces the server's certificate and key and reloads (TLS already on).
    pub fn replace_tls_files(&self, cert: &Path, key: &Path, ca: &Path) {
        self.install_tls_files(cert, key, ca);
        self.sql("postgres", "SELECT pg_reload_conf();");
    }

    fn install_tls_files(&self, cert: &Path, key: &Path, ca: &Path) {
        for (from, to, mode) in [
            (cert, "tls-server.pem", 0o644),
            (key, "tls-server.key", 0o600),
            (ca, "tls-ca.pem", 0o644),
        ] {
            let path = self.dir().join(to);
            std::fs::copy(from, &path).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            if as_root() {
                let user = nix::unistd::User::from_name(OS_USER).unwrap().unwrap();
                nix::unistd::chown(&path, Some(user.uid), Some(user.gid)).unwrap();
            }
        }
    }

    /// Waits until the reloaded configuration says `ssl` is `on` (reloads are asynchronous).
    fn wait_for_tls(&self, on: bool) {
        let want = if on { "on" } else { "off" };
        wait_until("postgres to reload ssl", Duration::from_secs(30), || {
            self.sql("postgres", "SHOW ssl;").trim() == want
        });
    }

    /// The data directory (also the socket directory; the server log is `postgres.log` in it).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Runs SQL as the `postgres` superuser on database `db` through the unix socket with psql
    /// (`-X -q -A -t -v ON_ERROR_STOP=1`), feeding the SQL on stdin (it may be long); returns stdout;
    /// panics with stderr on failure.
    pub fn sql(&self, db: &str, sql: &str) -> String {
        self.try_sql(db, sql).unwrap_or_else(|stderr| {
            panic!(
                "SQL failed on {db}: {}\n{stderr}",
                sql.chars().take(300).collect::<String>()
            )
        })
    }

    /// Like [`Postgres::sql`], but returns `Err(stderr)` instead of panicking.
    pub fn try_sql(&self, db: &str, sql: &str) -> Result<String, String> {
        let mut child = self
            .psql(db)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("psql (apt-get install postgresql-client-15)");
        // With ON_ERROR_STOP psql may exit before reading everything; its stderr (below) says why.
        let _ = child.stdin.take().unwrap().write_all(sql.as_bytes());
        let out = child.wait_with_output().unwrap();
        if out.status.success() {
            Ok(String::from_utf8(out.stdout).unwrap())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// `postgres://USER@127.0.0.1:PORT/DB`
    pub fn url(&self, user: &str, db: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/{db}", self.port)
    }

    /// `pg_ctl restart -m fast` (same port, same data); waits until it accepts connections.
    pub fn restart(&self) {
        self.pg_ctl(&["-m", "fast", "-w", "restart"]);
        self.wait_ready();
    }

    /// `pg_ctl stop -m fast`: the server gone until [`Postgres::start_again`].
    pub fn stop_fast(&self) {
        self.pg_ctl(&["-m", "fast", "-w", "stop"]);
    }

    /// Starts the server [`Postgres::stop_fast`] stopped (same port, same data).
    pub fn start_again(&self) {
        self.pg_ctl(&["-w", "start"]);
        self.wait_ready();
    }

    /// `pg_ctl stop -m immediate`: the server dies as in a crash (no shutdown checkpoint, walsenders
    /// cut off), as a failed primary does.
    pub fn stop_immediate(&self) {
        self.pg_ctl(&["-m", "immediate", "-w", "stop"]);
    }

    /// A physical standby of this server, streaming from it through the physical slot `slot` (its
    /// `application_name` too) with `hot_standby_feedback`; `extra` lines go into its
    /// postgresql.conf. The copy is a cold one (this server stops for it and starts again), which
    /// needs no client tool of this major; the slot, made first, keeps the WAL the standby needs.
    /// `primary_conninfo` names database `postgres`, which slot synchronization (17+) connects to.
    /// Returns once the standby streams.
    pub fn start_standby(&self, slot: &str, extra: &[&str]) -> Postgres {
        self.sql(
            "postgres",
            &format!("SELECT pg_create_physical_replication_slot('{slot}', true);"),
        );
        let dir = tempfile::Builder::new()
            .prefix("outboxd-postgres-standby-")
            .tempdir()
            .unwrap();
        let root = dir.path();
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700)).unwrap();
        self.stop_fast();
        let out = Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", self.dir().display()))
            .arg(root)
            .output()
            .expect("cp");
        assert!(out.status.success(), "copying the data directory: {out:?}");
        self.start_again();
        if as_root() {
            let user = nix::unistd::User::from_name(OS_USER).unwrap().unwrap();
            nix::unistd::chown(root, Some(user.uid), Some(user.gid)).unwrap();
        }
        let port = free_port();
        let standby = Postgres {
            log: root.join("postgres.log"),
            dir,
            port,
            bin: self.bin.clone(),
        };
        // The primary's log came along with the copy.
        std::fs::write(&standby.log, b"").unwrap();
        // Later lines win: the copy's own port and socket directory, then the standby's settings.
        let conf = format!(
            "\n# standby of {primary}\nport={port}\nunix_socket_directories='{d}'\n\
             primary_conninfo='host=127.0.0.1 port={primary} user={OS_USER} dbname=postgres application_name={slot}'\n\
             primary_slot_name='{slot}'\nhot_standby_feedback=on\n{extra}\n",
            primary = self.port,
            d = standby.dir().display(),
            extra = extra.join("\n"),
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(standby.dir().join("postgresql.conf"))
            .unwrap()
            .write_all(conf.as_bytes())
            .unwrap();
        let signal = standby.dir().join("standby.signal");
        std::fs::write(&signal, b"").unwrap();
        if as_root() {
            let user = nix::unistd::User::from_name(OS_USER).unwrap().unwrap();
            for path in [&signal, &standby.log] {
                nix::unistd::chown(path, Some(user.uid), Some(user.gid)).unwrap();
            }
        }
        standby.pg_ctl(&["-w", "start"]);
        standby.wait_ready();
        wait_until("the standby to stream", Duration::from_secs(60), || {
            self.sql(
                "postgres",
                &format!(
                    "SELECT count(*) FROM pg_stat_replication WHERE application_name = '{slot}' AND state = 'streaming';"
                ),
            )
            .trim()
                == "1"
        });
        standby
    }

    /// Promotes this standby (`pg_ctl promote`, waiting until it accepts writes).
    pub fn promote(&self) {
        self.pg_ctl(&["-w", "promote"]);
        wait_until(
            "the promoted server to leave recovery",
            Duration::from_secs(60),
            || self.sql("postgres", "SELECT pg_is_in_recovery();").trim() == "f",
        );
    }

    /// The postmaster's pid, from the first line of `postmaster.pid` (None when no server runs).
    pub fn postmaster_pid(&self) -> Option<nix::unistd::Pid> {
        let text = std::fs::read_to_string(self.dir().join("postmaster.pid")).ok()?;
        let pid = text.lines().next()?.trim().parse().ok()?;
        Some(nix::unistd::Pid::from_raw(pid))
    }

    /// psql as the `postgres` role on `db`, through the socket in the data directory.
    fn psql(&self, db: &str) -> Command {
        let mut cmd = Command::new(Path::new(BIN).join("psql"));
        cmd.arg("-h")
            .arg(self.dir())
            .arg("-p")
            .arg(self.port.to_string())
            .args(["-U", OS_USER, "-d", db])
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
            .env_remove("PGPASSWORD")
            .env_remove("PGSERVICE")
            .env_remove("PGOPTIONS");
        cmd
    }

    /// A server binary of this major, run as the `postgres` OS user when the tests run as root.
    fn server_command(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        let mut cmd = if as_root() {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", OS_USER, "--"]).arg(program);
            cmd
        } else {
            Command::new(program)
        };
        // The postgres user may not be allowed into the test's working directory.
        cmd.current_dir(self.dir()).stdin(Stdio::null());
        cmd
    }

    /// `pg_ctl -D DIR -l LOG ARGS`. The log file is always given, so the postmaster never inherits
    /// (and holds open) our pipes.
    fn pg_ctl_output(&self, args: &[&str]) -> std::io::Result<Output> {
        self.server_command("pg_ctl")
            .arg("-D")
            .arg(self.dir())
            .arg("-l")
            .arg(&self.log)
            .args(args)
            .output()
    }

    fn pg_ctl(&self, args: &[&str]) {
        let out = self.pg_ctl_output(args).expect("pg_ctl");
        assert!(
            out.status.success(),
            "pg_ctl {args:?} failed: {}{}\n--- server log ---\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }

    fn wait_ready(&self) {
        wait_until(
            "postgres to accept connections",
            Duration::from_secs(60),
            || {
                Command::new(Path::new(BIN).join("pg_isready"))
                    .arg("-h")
                    .arg(self.dir())
                    .arg("-p")
                    .arg(self.port.to_string())
                    .args(["-U", OS_USER, "-d", "postgres"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            },
        );
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // A frozen postmaster would not act on the stop signal.
        if let Some(pid) = self.postmaster_pid() {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
        }
        let _ = self.pg_ctl_output(&["-m", "immediate", "-w", "-t", "30", "stop"]);
        // The TempDir (the data directory) is removed after this.
    }
}

fn as_root() -> bool {
    nix::unistd::geteuid().is_root()
}
