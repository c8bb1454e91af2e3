//! The real `outboxd` binary, run as a child process with a config written for the test.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::mysqld::CDC_PASSWORD;
use super::wait_until;

pub struct Outboxd {
    pub dir: tempfile::TempDir,
    pub name: String,
    child: Option<Child>,
    runs: usize,
    /// The binary run: this build's, or another one (the benchmark's `--baseline`).
    pub binary: PathBuf,
    /// Environment every command of this pipeline gets (e.g. AWS credentials).
    pub env: Vec<(String, String)>,
    /// A command the binary runs under, e.g. `ip netns exec NS` (which execs it: the pid stays).
    pub wrapper: Vec<String>,
}

impl Outboxd {
    /// Prepares a pipeline `name` whose config is `config_body` (everything but `name`); the checkpoint
    /// dir is `<dir>/checkpoints`.
    pub fn new(name: &str, config_body: &str) -> Outboxd {
        Outboxd::with_checkpoint(name, config_body, "")
    }

    /// [`Outboxd::new`] with more `[checkpoint]` keys (e.g. `store = "kafka"`).
    pub fn with_checkpoint(name: &str, config_body: &str, checkpoint: &str) -> Outboxd {
        let dir = tempfile::Builder::new()
            .prefix("outboxd-run-")
            .tempdir()
            .unwrap();
        std::fs::create_dir(dir.path().join("checkpoints")).unwrap();
        // A quick checkpoint unless the test sets its own interval.
        let interval = if checkpoint.contains("interval_ms") {
            ""
        } else {
            "interval_ms = 20\n"
        };
        let config = format!(
            "name = \"{name}\"\n{config_body}\n[checkpoint]\ndir = \"{}\"\n{interval}{checkpoint}\n",
            dir.path().join("checkpoints").display()
        );
        std::fs::write(dir.path().join("outboxd.toml"), config).unwrap();
        Outboxd {
            dir,
            name: name.to_string(),
            child: None,
            runs: 0,
            // A copy set aside (`OUTBOXD_TEST_BINARY`) lets a long soak run while cargo builds.
            binary: std::env::var_os("OUTBOXD_TEST_BINARY").map_or_else(
                || PathBuf::from(env!("CARGO_BIN_EXE_outboxd")),
                PathBuf::from,
            ),
            env: Vec::new(),
            wrapper: Vec::new(),
        }
    }

    /// Replaces the config (same name and checkpoint dir) for the next start.
    pub fn rewrite_config(&self, config_body: &str) {
        let config = format!(
            "name = \"{}\"\n{config_body}\n[checkpoint]\ndir = \"{}\"\ninterval_ms = 20\n",
            self.name,
            self.dir.path().join("checkpoints").display()
        );
        std::fs::write(self.config_path(), config).unwrap();
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("outboxd.toml")
    }

    pub fn checkpoint_path(&self) -> PathBuf {
        self.dir
            .path()
            .join("checkpoints")
            .join(format!("{}.json", self.name))
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join(format!("run-{}.log", self.runs))
    }

    /// Runs `outboxd ARGS` to its end and returns its output. One that has not exited within three
    /// minutes is killed and fails the test with its stderr: a command expected to end must not
    /// hold the suite (`Command::output` waits forever).
    pub fn command_output(&self, args: &[&str]) -> std::process::Output {
        let limit = Duration::from_secs(180);
        let child = self
            .command(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = Pid::from_raw(child.id() as i32);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(child.wait_with_output());
        });
        if let Ok(output) = rx.recv_timeout(limit) {
            return output.unwrap();
        }
        let _ = kill(pid, Signal::SIGKILL);
        let output = rx.recv().unwrap().unwrap();
        panic!(
            "`outboxd {}` did not exit within {limit:?}; its stderr:\n{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// A command for `outboxd ARGS` with this pipeline's config and the source password in the env.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = match self.wrapper.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(&self.binary);
                cmd
            }
            None => Command::new(&self.binary),
        };
        // Tests read outboxd's debug lines; the benchmark (`OUTBOXD_RIG_LOG=default`, set by
        // benches/run.sh) measures outboxd at its own default level, as users run it.
        match std::env::var("OUTBOXD_RIG_LOG").as_deref() {
            Ok("default") => cmd.env_remove("RUST_LOG"),
            _ => cmd.env("RUST_LOG", "info,outboxd=debug"),
        };
        cmd.arg("--config")
            .arg(self.config_path())
            .args(args)
            .env("OUTBOXD_SOURCE__PASSWORD", CDC_PASSWORD)
            .env_remove("OUTBOXD_CONFIG")
            .env_remove("FAILPOINTS")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// Starts `outboxd run` and waits until its stream (or its snapshot) opened: the start position
    /// is fixed in the checkpoint by then.
    pub fn start(&mut self) {
        self.start_with(&[]);
    }

    /// [`Outboxd::start`] with extra `run` arguments (e.g. `--skip-checks`).
    pub fn start_with(&mut self, extra: &[&str]) {
        self.start_with_env(extra, &[]);
    }

    /// [`Outboxd::start_with`] with extra environment variables (e.g. `FAILPOINTS`).
    pub fn start_with_env(&mut self, extra: &[&str], env: &[(&str, &str)]) {
        // A first start with a snapshot opens the stream only once the tables are read.
        self.start_until(
            extra,
            env,
            &["stream opened", "snapshot started", "resuming the snapshot"],
        );
    }

    /// Starts `outboxd run` and waits until its log has one of `lines` (a standby never opens
    /// the stream: wait for "standing by").
    pub fn start_until(&mut self, extra: &[&str], env: &[(&str, &str)], lines: &[&str]) {
        assert!(self.child.is_none(), "already running");
        self.runs += 1;
        let log = std::fs::File::create(self.log_path()).unwrap();
        let child = self
            .command(&[&["run"][..], extra].concat())
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let log_path = self.log_path();
        let started = std::time::Instant::now();
        wait_until(
            "outboxd to open the binlog stream",
            Duration::from_secs(60),
            || {
                if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                    panic!(
                        "outboxd exited early with {status}:\n{}",
                        std::fs::read_to_string(&log_path).unwrap_or_default()
                    );
                }
                if started.elapsed() > Duration::from_secs(58) {
                    panic!(
                        "outboxd did not log any of {lines:?}:\n{}",
                        std::fs::read_to_string(&log_path).unwrap_or_default()
                    );
                }
                lines
                    .iter()
                    .any(|line| super::file_contains(&log_path, line))
            },
        );
    }

    /// Starts `outboxd run` with `extra` arguments and returns at once (a supervisor watches it:
    /// [`Outboxd::exited`]).
    pub fn spawn(&mut self, extra: &[&str]) {
        assert!(self.child.is_none(), "already running");
        self.runs += 1;
        let log = std::fs::File::create(self.log_path()).unwrap();
        let child = self
            .command(&[&["run"][..], extra].concat())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// The exit status once the started process exited by itself (it is then no longer running).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut()?.try_wait().unwrap()?;
        self.child = None;
        Some(status)
    }

    /// Whether a process was started and not yet seen to exit.
    pub fn started(&self) -> bool {
        self.child.is_some()
    }

    /// Whether the started process is still running.
    pub fn child_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.as_ref().expect("running").id() as i32)
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(&mut self) -> ExitStatus {
        let status = self.terminate();
        assert!(
            status.success(),
            "outboxd did not exit cleanly on SIGTERM: {status}\n{}",
            self.log()
        );
        status
    }

    /// SIGTERM and wait, whatever the exit (a harness that records exits rather than fail on them);
    /// SIGKILL after three minutes (outboxd bounds its own shutdown at the drain deadline plus 90 s,
    /// plus three takeover timeouts with the Kafka checkpoint store: below that in every test but
    /// the ones with a 45 s takeover; a hang must end the wait, and shows as a kill in the status).
    pub fn terminate(&mut self) -> ExitStatus {
        let _ = kill(self.pid(), Signal::SIGTERM);
        let mut child = self.child.take().unwrap();
        let limit = std::time::Instant::now() + Duration::from_secs(180);
        while std::time::Instant::now() < limit {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        child.wait().unwrap()
    }

    /// SIGKILL if a process runs, ignoring every error (for cleanup after a panic).
    pub fn kill_if_running(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGKILL: no chance to drain or checkpoint.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().unwrap();
        child.kill().unwrap();
        let _ = child.wait();
    }

    /// Waits for the running process to exit by itself (bounded), returning its status.
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let start = std::time::Instant::now();
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return status;
            }
            if start.elapsed() > limit {
                panic!(
                    "outboxd did not exit within {limit:?}; its log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The saved checkpoint; panics when none was saved yet (an assertion on it must not pass
    /// because there is nothing to compare).
    pub fn checkpoint(&self) -> serde_json::Value {
        let checkpoint = self.checkpoint_or_null();
        assert!(
            !checkpoint.is_null(),
            "outboxd saved no checkpoint at {}",
            self.checkpoint_path().display()
        );
        checkpoint
    }

    /// The saved checkpoint, or `Null` before the first save: for waits, which read "not yet"
    /// (the file is replaced by rename, so it is never seen half written).
    pub fn checkpoint_or_null(&self) -> serde_json::Value {
        match std::fs::read_to_string(self.checkpoint_path()) {
            Ok(text) => serde_json::from_str(&text).unwrap(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => panic!("reading {}: {e}", self.checkpoint_path().display()),
        }
    }

    pub fn dir_path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Outboxd {
    fn drop(&mut self) {
        self.kill_if_running();
    }
}
