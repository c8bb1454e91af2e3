//! A private moto server (PyPI's `moto[server]`, installed by scripts/install-test-deps.sh into a
//! virtualenv in the test cache) on a free loopback port: SQS and SNS as their APIs answer, in
//! memory. A client (the AWS SDK the sinks use) creates queues and topics and reads queues back.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use aws_sdk_sqs::types::{MessageSystemAttributeName, QueueAttributeName};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::rabbitmq::block_on;
use super::{free_port, wait_until, Consumed};

/// The secret the rig's credentials carry: planted, so tests can assert it is never printed.
pub const SECRET_KEY: &str = "planted-aws-secret-81";
pub const SESSION_TOKEN: &str = "planted-aws-session-82";
pub const REGION: &str = "eu-west-1";

pub struct Moto {
    dir: tempfile::TempDir,
    pub port: u16,
    child: Option<Child>,
}

/// A message read back from a queue.
#[derive(Debug, Clone)]
pub struct Got {
    pub body: String,
    pub attributes: BTreeMap<String, Vec<u8>>,
    pub group: Option<String>,
    pub dedup: Option<String>,
    /// When the queue took it (ms since the Unix epoch).
    pub sent_ms: u64,
}

impl Got {
    /// As a Kafka record would read (the `outboxd.key` attribute as key), so that the Kafka
    /// tests' checks apply; `topic` stands for the queue.
    pub fn as_consumed(&self, topic: &str, offset: i64) -> Consumed {
        let mut headers: BTreeMap<String, Option<Vec<u8>>> = self
            .attributes
            .iter()
            .map(|(k, v)| (k.clone(), Some(v.clone())))
            .collect();
        let key = headers.remove("outboxd.key").flatten();
        Consumed {
            topic: topic.to_string(),
            partition: 0,
            offset,
            key,
            value: Some(self.body.clone().into_bytes()),
            headers,
            timestamp: None,
        }
    }

    pub fn attribute(&self, name: &str) -> Option<String> {
        self.attributes
            .get(name)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }
}

/// moto_server from the test cache (or `OUTBOXD_MOTO`).
fn binary() -> std::path::PathBuf {
    if let Ok(path) = std::env::var("OUTBOXD_MOTO") {
        return path.into();
    }
    let cache = std::env::var("OUTBOXD_TEST_CACHE")
        .unwrap_or_else(|_| format!("{}/.cache/outboxd-test", std::env::var("HOME").unwrap()));
    let path = std::path::PathBuf::from(cache).join("moto-5.2.5/bin/moto_server");
    assert!(
        path.exists(),
        "{} is missing: run scripts/install-test-deps.sh",
        path.display()
    );
    path
}

impl Moto {
    pub fn start() -> Moto {
        let dir = tempfile::tempdir().unwrap();
        let mut moto = Moto {
            dir,
            port: free_port(),
            child: None,
        };
        moto.boot();
        moto
    }

    /// Starts the server (again after [`Moto::kill9`]: empty, on the same port).
    pub fn boot(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("moto.log")).unwrap();
        let child = Command::new(binary())
            .args(["-H", "127.0.0.1", "-p", &self.port.to_string()])
            .current_dir(self.dir.path())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let port = self.port;
        wait_until("moto to answer", Duration::from_secs(60), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
    }

    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = kill(Pid::from_raw(-(child.id() as i32)), Signal::SIGKILL);
            let _ = child.wait();
        }
    }

    /// Stops answering (SIGSTOP) until [`Moto::thaw`].
    pub fn freeze(&self) {
        if let Some(child) = &self.child {
            kill(Pid::from_raw(-(child.id() as i32)), Signal::SIGSTOP).unwrap();
        }
    }

    pub fn thaw(&self) {
        if let Some(child) = &self.child {
            kill(Pid::from_raw(-(child.id() as i32)), Signal::SIGCONT).unwrap();
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// What outboxd needs in its environment to reach this server (and nothing of the machine's
    /// own AWS setup).
    pub fn env() -> Vec<(String, String)> {
        [
            ("AWS_ACCESS_KEY_ID", "AKIAOUTBOXDTEST"),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_SESSION_TOKEN", SESSION_TOKEN),
            ("AWS_EC2_METADATA_DISABLED", "true"),
            ("AWS_CONFIG_FILE", "/dev/null"),
            ("AWS_SHARED_CREDENTIALS_FILE", "/dev/null"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    fn sdk(&self) -> aws_config::SdkConfig {
        let credentials =
            aws_sdk_sqs::config::Credentials::new("AKIAOUTBOXDTEST", SECRET_KEY, None, None, "rig");
        block_on(
            aws_config::defaults(aws_config::BehaviorVersion::latest())
                .http_client(
                    aws_smithy_http_client::Builder::new()
                        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
                        ))
                        .build_https(),
                )
                .region(aws_config::Region::new(REGION))
                .endpoint_url(self.endpoint())
                .credentials_provider(credentials)
                .load(),
        )
    }

    pub fn sqs(&self) -> aws_sdk_sqs::Client {
        aws_sdk_sqs::Client::new(&self.sdk())
    }

    pub fn sns(&self) -> aws_sdk_sns::Client {
        aws_sdk_sns::Client::new(&self.sdk())
    }

    /// Creates queue `name` (FIFO when it ends in `.fifo`) with `attributes`; returns its URL.
    pub fn create_queue(&self, name: &str, attributes: &[(&str, &str)]) -> String {
        let sqs = self.sqs();
        let mut call = sqs.create_queue().queue_name(name);
        if name.ends_with(".fifo") {
            call = call.attributes(QueueAttributeName::FifoQueue, "true");
        }
        for (k, v) in attributes {
            call = call.attributes(QueueAttributeName::from(*k), *v);
        }
        block_on(call.send())
            .unwrap()
            .queue_url()
            .unwrap()
            .to_string()
    }

    /// Creates topic `name` (FIFO when it ends in `.fifo`); returns its ARN.
    pub fn create_topic(&self, name: &str) -> String {
        let sns = self.sns();
        let mut call = sns.create_topic().name(name);
        if name.ends_with(".fifo") {
            call = call.attributes("FifoTopic", "true");
        }
        block_on(call.send())
            .unwrap()
            .topic_arn()
            .unwrap()
            .to_string()
    }

    /// Subscribes queue `queue_url` to topic `arn`, raw (the message as published, attributes
    /// as message attributes).
    pub fn subscribe(&self, arn: &str, queue_url: &str) {
        let sqs = self.sqs();
        let queue_arn = block_on(
            sqs.get_queue_attributes()
                .queue_url(queue_url)
                .attribute_names(QueueAttributeName::QueueArn)
                .send(),
        )
        .unwrap()
        .attributes()
        .unwrap()[&QueueAttributeName::QueueArn]
            .clone();
        block_on(
            self.sns()
                .subscribe()
                .topic_arn(arn)
                .protocol("sqs")
                .endpoint(queue_arn)
                .attributes("RawMessageDelivery", "true")
                .send(),
        )
        .unwrap();
    }

    /// Reads and deletes messages of queue `name` until `expected` were read or the queue stays
    /// empty for 2 s after `limit`.
    pub fn read(&self, name: &str, expected: usize, limit: Duration) -> Vec<Got> {
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + limit;
        let mut empty_since: Option<std::time::Instant> = None;
        loop {
            let taken = self.take(name);
            if taken.is_empty() {
                let since = *empty_since.get_or_insert_with(std::time::Instant::now);
                if got.len() >= expected && since.elapsed() > Duration::from_secs(1)
                    || std::time::Instant::now() > deadline
                        && since.elapsed() > Duration::from_secs(2)
                {
                    return got;
                }
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            empty_since = None;
            got.extend(taken);
        }
    }

    /// One `ReceiveMessage` (up to 10) of queue `name`; each message read is deleted. moto,
    /// unlike SQS, de-duplicates a FIFO message only against messages still in the queue, and
    /// slows down as a FIFO queue grows: tests read while outboxd sends, and judge repeats by
    /// their de-duplication id and send time.
    pub fn take(&self, name: &str) -> Vec<Got> {
        let sqs = self.sqs();
        let url = block_on(sqs.get_queue_url().queue_name(name).send())
            .unwrap()
            .queue_url()
            .unwrap()
            .to_string();
        let answer = block_on(
            sqs.receive_message()
                .queue_url(&url)
                .max_number_of_messages(10)
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .send(),
        )
        .unwrap();
        let mut got = Vec::new();
        for m in answer.messages() {
            let attributes = m
                .message_attributes()
                .into_iter()
                .flatten()
                .map(|(k, v)| {
                    let bytes = match (v.string_value(), v.binary_value()) {
                        (Some(s), _) => s.as_bytes().to_vec(),
                        (None, Some(b)) => b.as_ref().to_vec(),
                        (None, None) => Vec::new(),
                    };
                    (k.clone(), bytes)
                })
                .collect();
            let system =
                |a: MessageSystemAttributeName| m.attributes().and_then(|s| s.get(&a)).cloned();
            got.push(Got {
                body: m.body().unwrap_or_default().to_string(),
                attributes,
                group: system(MessageSystemAttributeName::MessageGroupId),
                dedup: system(MessageSystemAttributeName::MessageDeduplicationId),
                sent_ms: system(MessageSystemAttributeName::SentTimestamp)
                    .and_then(|t| t.parse().ok())
                    .unwrap_or_default(),
            });
            block_on(
                sqs.delete_message()
                    .queue_url(&url)
                    .receipt_handle(m.receipt_handle().unwrap())
                    .send(),
            )
            .unwrap();
        }
        got
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// An outboxd config reading MariaDB's outbox into the `[sqs]` (or `[sns]`) section with `extra`.
pub fn config_with_aws(db_url: &str, section: &str, endpoint: &str, extra: &str) -> String {
    format!(
        "[source]\nkind = \"mysql\"\nurl = \"{db_url}\"\ntables = [\"app.outbox\"]\nserver_id = 99\nheartbeat_interval_ms = 1000\n\
         [{section}]\nregion = \"{REGION}\"\nendpoint_url = \"{endpoint}\"\n{extra}\n[http]\nlisten = \"\"\n"
    )
}
