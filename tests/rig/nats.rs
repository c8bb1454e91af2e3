//! A private NATS server with JetStream (Debian's `nats-server`) on a free loopback port, and a
//! client to add streams and read them back with (async-nats, the library the sink uses).

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::rabbitmq::block_on;
use super::{free_port, wait_until, Consumed};

pub struct Nats {
    dir: tempfile::TempDir,
    /// The address it listens on (loopback unless [`Nats::start_on`] named another).
    host: String,
    pub port: u16,
    /// Credentials the client rig uses (`user`/`password` or a token), when the server wants any.
    auth: Auth,
    tls: Option<std::path::PathBuf>,
    child: Option<Child>,
}

#[derive(Clone)]
pub enum Auth {
    None,
    User(String, String),
    Token(String),
}

/// A message read back from a stream.
pub struct Got {
    pub subject: String,
    pub headers: BTreeMap<String, String>,
    pub payload: Vec<u8>,
}

impl Got {
    /// As a Kafka record would read (subject as topic, the `outboxd.key` header as key), so that
    /// the Kafka tests' checks apply.
    pub fn as_consumed(&self, offset: i64) -> Consumed {
        let mut headers: BTreeMap<String, Option<Vec<u8>>> = self
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), Some(v.clone().into_bytes())))
            .collect();
        let key = headers.remove("outboxd.key").flatten();
        Consumed {
            topic: self.subject.clone(),
            partition: 0,
            offset,
            key,
            value: Some(self.payload.clone()),
            headers,
            timestamp: None,
        }
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.headers.get(name).cloned()
    }
}

impl Nats {
    pub fn start() -> Nats {
        Self::start_with(Auth::None, "", None)
    }

    /// A server with `auth` required, `conf` added to its config, and TLS (`server` signed by the
    /// CA `ca`) when given.
    pub fn start_with(
        auth: Auth,
        conf: &str,
        tls: Option<(&std::path::Path, &super::certs::Issued)>,
    ) -> Nats {
        Self::start_at("127.0.0.1", auth, conf, tls)
    }

    /// A server without credentials listening on `host` (a network namespace's host end, which
    /// this side reaches too) instead of loopback.
    pub fn start_on(host: &str) -> Nats {
        Self::start_at(host, Auth::None, "", None)
    }

    fn start_at(
        host: &str,
        auth: Auth,
        conf: &str,
        tls: Option<(&std::path::Path, &super::certs::Issued)>,
    ) -> Nats {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let authorization = match &auth {
            Auth::None => String::new(),
            Auth::User(user, password) => {
                format!("authorization {{ user: \"{user}\", password: \"{password}\" }}\n")
            }
            Auth::Token(token) => format!("authorization {{ token: \"{token}\" }}\n"),
        };
        let tls_block = match tls {
            Some((_, server)) => format!(
                "tls {{ cert_file: \"{}\", key_file: \"{}\" }}\n",
                server.cert.display(),
                server.key.display()
            ),
            None => String::new(),
        };
        std::fs::write(
            dir.path().join("nats.conf"),
            format!(
                "listen: {host}:{port}\njetstream {{ store_dir: \"{}\" }}\n{authorization}{tls_block}{conf}",
                dir.path().join("js").display()
            ),
        )
        .unwrap();
        let mut nats = Nats {
            dir,
            host: host.to_string(),
            port,
            auth,
            tls: tls.map(|(ca, _)| ca.to_path_buf()),
            child: None,
        };
        nats.boot();
        nats
    }

    /// Starts the server (again, after [`Nats::kill9`]: same store, same streams).
    pub fn boot(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("server.out")).unwrap();
        let child = Command::new("nats-server")
            .arg("-c")
            .arg(self.dir.path().join("nats.conf"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("nats-server runs (scripts/install-test-deps.sh installs it)");
        self.child = Some(child);
        wait_until("NATS JetStream to answer", Duration::from_secs(30), || {
            block_on(async {
                let Ok(client) = self.client().await else {
                    return false;
                };
                // async-nats's account type wants fields nats-server 2.9 does not send.
                client
                    .request("$JS.API.INFO", bytes::Bytes::new())
                    .await
                    .is_ok_and(|reply| {
                        !String::from_utf8_lossy(&reply.payload).contains("\"error\"")
                    })
            })
        });
    }

    /// `nats://HOST:PORT` with the server's credentials in it (`tls://` for TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "tls" } else { "nats" };
        match &self.auth {
            Auth::None => format!("{scheme}://{}:{}", self.host, self.port),
            Auth::User(user, password) => {
                format!("{scheme}://{user}:{password}@{}:{}", self.host, self.port)
            }
            Auth::Token(token) => format!("{scheme}://{token}@{}:{}", self.host, self.port),
        }
    }

    async fn client(&self) -> Result<async_nats::Client, async_nats::ConnectError> {
        let mut options = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(2))
            .max_reconnects(Some(1));
        match &self.auth {
            Auth::None => {}
            Auth::User(user, password) => {
                options = options.user_and_password(user.clone(), password.clone())
            }
            Auth::Token(token) => options = options.token(token.clone()),
        }
        if let Some(ca) = &self.tls {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        options
            .connect(format!("nats://{}:{}", self.host, self.port))
            .await
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn log_path(&self) -> std::path::PathBuf {
        self.dir.path().join("server.out")
    }

    fn pid(&self) -> Option<Pid> {
        self.child.as_ref().map(|c| Pid::from_raw(c.id() as i32))
    }

    /// SIGKILL of the server process. What JetStream acknowledged survives it because the process
    /// wrote it to its file store (the kernel's page cache has it); it is not synced to disk at
    /// each acknowledgement, so a host crash is another matter (see docs/sinks/nats.md).
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

    /// Deletes message `sequence` of stream `name` (as an operator's `nats stream rmm` would).
    pub fn delete_message(&self, name: &str, sequence: u64) {
        block_on(async {
            let js = jetstream::new(self.client().await.unwrap());
            let stream = js.get_stream(name).await.unwrap();
            stream.delete_message(sequence).await.unwrap();
        });
    }

    /// Removes every message of stream `name` (as `nats stream purge` would).
    pub fn purge(&self, name: &str) {
        block_on(async {
            let js = jetstream::new(self.client().await.unwrap());
            let stream = js.get_stream(name).await.unwrap();
            stream.purge().await.unwrap();
        });
    }

    /// A file-backed stream `name` capturing `subjects` (duplicate window 2 minutes).
    pub fn add_stream(&self, name: &str, subjects: &[&str]) {
        self.add_stream_with_window(name, subjects, Duration::from_secs(120))
    }

    /// A stream made from `config` as it is (its other settings: the server's defaults).
    pub fn add_stream_config(&self, config: stream::Config) {
        block_on(async {
            let js = jetstream::new(self.client().await.unwrap());
            js.create_stream(config).await.unwrap();
        });
    }

    /// Changes stream `name`'s settings with `change` (the others stay as they are).
    pub fn update_stream(&self, name: &str, change: impl FnOnce(&mut stream::Config)) {
        block_on(async {
            let js = jetstream::new(self.client().await.unwrap());
            let mut config = js
                .get_stream(name)
                .await
                .unwrap()
                .info()
                .await
                .unwrap()
                .config
                .clone();
            change(&mut config);
            js.update_stream(config).await.unwrap();
        });
    }

    /// Publishes `payload` to `subject` as another application would, with `Nats-Msg-Id`
    /// `msg_id`, and waits for its `PubAck`.
    pub fn publish(&self, subject: &str, msg_id: &str, payload: &str) {
        block_on(async {
            let js = jetstream::new(self.client().await.unwrap());
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", msg_id);
            js.publish_with_headers(subject.to_string(), headers, payload.to_string().into())
                .await
                .unwrap()
                .await
                .unwrap();
        });
    }

    /// Publishes `payload` to `subject` with `headers`, and waits for its `PubAck`.
    pub fn publish_with(&self, subject: &str, headers: &[(&str, &str)], payload: &[u8]) {
        block_on(async {
            let js = jetstream::new(self.client().await.unwrap());
            let mut map = async_nats::HeaderMap::new();
            for (name, value) in headers {
                map.insert(*name, *value);
            }
            js.publish_with_headers(subject.to_string(), map, payload.to_vec().into())
                .await
                .unwrap()
                .await
                .unwrap();
        });
    }

    /// [`Nats::add_stream`] with another duplicate window.
    pub fn add_stream_with_window(&self, name: &str, subjects: &[&str], window: Duration) {
        block_on(async {
            let js = jetstream::new(self.client().await.unwrap());
            js.create_stream(stream::Config {
                name: name.into(),
                subjects: subjects.iter().map(|s| s.to_string()).collect(),
                storage: stream::StorageType::File,
                duplicate_window: window,
                ..Default::default()
            })
            .await
            .unwrap();
        });
    }

    /// Reads every message of stream `name` until at least `expected` are there and none came for
    /// 2 s (duplicates are read too), or `limit` passed.
    pub fn read(&self, name: &str, expected: usize, limit: Duration) -> Vec<Got> {
        block_on(async {
            let js = jetstream::new(self.client().await.unwrap());
            let mut stream = js.get_stream(name).await.unwrap();
            let start = std::time::Instant::now();
            let mut last = (0, std::time::Instant::now());
            loop {
                let count = stream.info().await.unwrap().state.messages;
                if count != last.0 {
                    last = (count, std::time::Instant::now());
                }
                let quiet = last.1.elapsed() > Duration::from_secs(2);
                if (count as usize >= expected && quiet) || start.elapsed() > limit {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let info = stream.info().await.unwrap().state.clone();
            let mut got = Vec::new();
            for sequence in info.first_sequence..=info.last_sequence {
                let Ok(m) = stream.get_raw_message(sequence).await else {
                    continue;
                };
                got.push(Got {
                    subject: m.subject.to_string(),
                    headers: m
                        .headers
                        .iter()
                        .map(|(k, v)| (k.to_string(), v[0].as_str().to_string()))
                        .collect(),
                    payload: m.payload.to_vec(),
                });
            }
            got
        })
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The rig's config for a MariaDB pipeline publishing to `url` (`extra` goes into `[nats]`).
pub fn config_with_nats(db_url: &str, url: &str, extra: &str) -> String {
    format!(
        "[source]\nkind = \"mysql\"\nurl = \"{db_url}\"\ntables = [\"app.outbox\"]\nserver_id = 99\nheartbeat_interval_ms = 1000\n\
         [nats]\nurl = \"{url}\"\n{extra}\n[http]\nlisten = \"\"\n"
    )
}
