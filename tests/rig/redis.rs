//! A private redis-server (Debian's) on a free loopback port, durable (`appendonly yes`,
//! `appendfsync always`), and a client to read streams back with (redis-rs, the library the sink
//! uses).

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::rabbitmq::block_on;
use super::{free_port, wait_until, Consumed};

pub struct Redis {
    /// The data dir and the server's log (`server.log`), removed on drop.
    _dir: tempfile::TempDir,
    pub port: u16,
    password: Option<String>,
    /// TLS: the CA the client rig trusts.
    tls: Option<std::path::PathBuf>,
    args: Vec<String>,
    child: Option<Child>,
}

/// An entry read back from a stream.
pub struct Got {
    pub stream: String,
    pub fields: BTreeMap<String, Vec<u8>>,
}

impl Got {
    /// As a Kafka record would read (stream as topic, fields `key` and `payload`, the rest as
    /// headers), so that the Kafka tests' checks apply.
    pub fn as_consumed(&self, offset: i64) -> Consumed {
        let mut headers: BTreeMap<String, Option<Vec<u8>>> = self
            .fields
            .iter()
            .map(|(k, v)| (k.clone(), Some(v.clone())))
            .collect();
        let key = headers.remove("key").flatten();
        let value = headers.remove("payload").flatten();
        Consumed {
            topic: self.stream.clone(),
            partition: 0,
            offset,
            key,
            value,
            headers,
            timestamp: None,
        }
    }

    pub fn field(&self, name: &str) -> Option<String> {
        self.fields
            .get(name)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }
}

impl Redis {
    pub fn start() -> Redis {
        Self::start_with(None, &[], None)
    }

    /// A server wanting `password` (for the default user), with `extra` arguments, and TLS only
    /// (`server` signed by the CA `ca`) when given.
    pub fn start_with(
        password: Option<&str>,
        extra: &[&str],
        tls: Option<(&std::path::Path, &super::certs::Issued)>,
    ) -> Redis {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut args: Vec<String> = vec![
            "--bind".into(),
            "127.0.0.1".into(),
            "--dir".into(),
            dir.path().display().to_string(),
            "--save".into(),
            "".into(),
            "--appendonly".into(),
            "yes".into(),
            "--appendfsync".into(),
            "always".into(),
            "--daemonize".into(),
            "no".into(),
            "--logfile".into(),
            dir.path().join("server.log").display().to_string(),
        ];
        match tls {
            Some((ca, server)) => args.extend(
                [
                    "--port",
                    "0",
                    "--tls-port",
                    &port.to_string(),
                    "--tls-cert-file",
                    &server.cert.display().to_string(),
                    "--tls-key-file",
                    &server.key.display().to_string(),
                    "--tls-ca-cert-file",
                    &ca.display().to_string(),
                    "--tls-auth-clients",
                    "no",
                ]
                .map(String::from),
            ),
            None => args.extend(["--port".to_string(), port.to_string()]),
        }
        if let Some(password) = password {
            args.extend(["--requirepass".to_string(), password.to_string()]);
        }
        args.extend(extra.iter().map(|a| a.to_string()));
        let mut redis = Redis {
            _dir: dir,
            port,
            password: password.map(str::to_string),
            tls: tls.map(|(ca, _)| ca.to_path_buf()),
            args,
            child: None,
        };
        redis.boot();
        redis
    }

    /// Starts the server (again, after [`Redis::kill9`]: same dir, same append-only file).
    pub fn boot(&mut self) {
        let child = Command::new("redis-server")
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("redis-server runs (scripts/install-test-deps.sh installs it)");
        self.child = Some(child);
        wait_until("Redis to answer PING", Duration::from_secs(30), || {
            self.try_cmd::<String>(&mut redis::cmd("PING")).is_ok()
        });
    }

    /// The server's log file.
    pub fn log_path(&self) -> std::path::PathBuf {
        self._dir.path().join("server.log")
    }

    /// `redis://[:password@]127.0.0.1:PORT/0` (`rediss://` with TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        match &self.password {
            Some(p) => format!("{scheme}://:{p}@127.0.0.1:{}/0", self.port),
            None => format!("{scheme}://127.0.0.1:{}/0", self.port),
        }
    }

    fn try_cmd<T: redis::FromRedisValue>(&self, cmd: &mut redis::Cmd) -> redis::RedisResult<T> {
        block_on(async {
            let client = match &self.tls {
                Some(ca) => redis::Client::build_with_tls(
                    self.url().as_str(),
                    redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(std::fs::read(ca).unwrap()),
                    },
                )?,
                None => redis::Client::open(self.url().as_str())?,
            };
            let mut connection = client.get_multiplexed_async_connection().await?;
            cmd.query_async(&mut connection).await
        })
    }

    /// Runs one command (panics on an error).
    pub fn cmd<T: redis::FromRedisValue>(&self, cmd: &mut redis::Cmd) -> T {
        self.try_cmd(cmd).expect("a command to the test Redis")
    }

    fn pid(&self) -> Option<Pid> {
        self.child.as_ref().map(|c| Pid::from_raw(c.id() as i32))
    }

    pub fn kill9(&mut self) {
        if let Some(pid) = self.pid() {
            let _ = kill(pid, Signal::SIGCONT);
            let _ = kill(pid, Signal::SIGKILL);
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }

    pub fn freeze(&self) {
        kill(self.pid().unwrap(), Signal::SIGSTOP).unwrap();
    }

    pub fn thaw(&self) {
        let _ = kill(self.pid().unwrap(), Signal::SIGCONT);
    }

    /// Every entry of `streams` (in stream order, one stream after the other) once at least
    /// `expected` are there in all and none came for 2 s, or `limit` passed.
    pub fn read(&self, streams: &[&str], expected: usize, limit: Duration) -> Vec<Got> {
        let start = std::time::Instant::now();
        let mut last = (0usize, std::time::Instant::now());
        loop {
            let count: usize = streams
                .iter()
                .map(|s| self.cmd::<usize>(redis::cmd("XLEN").arg(*s)))
                .sum();
            if count != last.0 {
                last = (count, std::time::Instant::now());
            }
            if (count >= expected && last.1.elapsed() > Duration::from_secs(2))
                || start.elapsed() > limit
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut got = Vec::new();
        for stream in streams {
            let entries: Vec<(String, Vec<Vec<u8>>)> =
                self.cmd(redis::cmd("XRANGE").arg(*stream).arg("-").arg("+"));
            for (_, flat) in entries {
                let fields = flat
                    .chunks(2)
                    .map(|pair| {
                        (
                            String::from_utf8_lossy(&pair[0]).into_owned(),
                            pair[1].clone(),
                        )
                    })
                    .collect();
                got.push(Got {
                    stream: stream.to_string(),
                    fields,
                });
            }
        }
        got
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The rig's config for a MariaDB pipeline publishing to `url` (`extra` goes into `[redis]`).
pub fn config_with_redis(db_url: &str, url: &str, extra: &str) -> String {
    format!(
        "[source]\nkind = \"mysql\"\nurl = \"{db_url}\"\ntables = [\"app.outbox\"]\nserver_id = 99\nheartbeat_interval_ms = 1000\n\
         [redis]\nurl = \"{url}\"\n{extra}\n[http]\nlisten = \"\"\n"
    )
}
