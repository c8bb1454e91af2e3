//! Configuration: one TOML file plus `OUTBOXD_` environment overrides, validated up front.
//!
//! The whole schema of the design contract parses today, including keys whose features live in other
//! modules or later releases, so a config written now keeps working. Unknown keys are an error naming the
//! key (a typo must never silently fall back to a default). Overrides use the key path with `__`
//! between levels: `OUTBOXD_KAFKA__BROKERS=…` sets `kafka.brokers`. A value that parses as a TOML
//! literal (number, boolean, array, quoted string) is taken as such, anything else as a plain string.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Result};
pub use crate::retention::PruneConfig;
pub use crate::route::RouteConfig;
pub use crate::secrets::is_secret_key;
pub use crate::sink::aws::config::AwsConfig;
pub use crate::sink::kafka::config::KafkaConfig;
pub use crate::sink::nats::config::NatsConfig;
pub use crate::sink::rabbitmq::config::RabbitMqConfig;
pub use crate::sink::redis::config::RedisConfig;
pub use crate::sink::{Delivery, SinkConfig};
use crate::source::config::url_secrets;
pub use crate::source::config::{
    redact_url, source_urls, MysqlOptions, PostgresOptions, SourceConfig, SourceDb, SourceKind,
    TlsConfig, TlsMode,
};

/// Environment variable naming the config file when `--config` is absent.
pub const CONFIG_ENV: &str = "OUTBOXD_CONFIG";
const ENV_PREFIX: &str = "OUTBOXD_";

#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Pipeline name: names the checkpoint (file, record or key) and labels every metric. One per
    /// pipeline; instances sharing a name and a Kafka checkpoint are standbys of each other.
    pub name: String,
    /// The database whose log is read, and the outbox tables.
    pub source: SourceConfig,
    /// How a row becomes a record: destination, key, value, id and headers. The defaults are
    /// those of Debezium's Outbox Event Router.
    #[serde(default)]
    pub route: RouteConfig,
    /// The Kafka sink (idempotent producer, `acks=all`; exactly-once with `exactly_once`). The
    /// sink is exactly one of `[kafka]`, `[rabbitmq]`, `[nats]`, `[redis]`, `[sqs]`, `[sns]`.
    #[serde(default)]
    pub kafka: Option<KafkaConfig>,
    /// The RabbitMQ sink (AMQP 0.9.1, publisher confirms, mandatory publishing to an existing
    /// exchange).
    #[serde(default)]
    pub rabbitmq: Option<RabbitMqConfig>,
    /// The NATS JetStream sink (each message acknowledged by the stream, de-duplicated by
    /// `Nats-Msg-Id`).
    #[serde(default)]
    pub nats: Option<NatsConfig>,
    /// The Redis Streams sink (`XADD`; exactly-once with `checkpoint.store = "redis"`).
    #[serde(default)]
    pub redis: Option<RedisConfig>,
    /// The Amazon SQS sink (standard and FIFO queues; `SendMessageBatch`).
    #[serde(default)]
    pub sqs: Option<AwsConfig>,
    /// The Amazon SNS sink (standard and FIFO topics; `PublishBatch`).
    #[serde(default)]
    pub sns: Option<AwsConfig>,
    /// Where the position of what the broker acknowledged is kept, and how often it is written.
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// The HTTP server for `/metrics`, `/healthz` and `/readyz`.
    #[serde(default)]
    pub http: HttpConfig,
    /// Deleting forwarded rows from the outbox tables (in `run` and `outboxd prune`); without this
    /// section outboxd never deletes.
    #[serde(default)]
    pub prune: Option<PruneConfig>,
}

#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Where the checkpoint lives: a file in `dir`, a record in a compacted Kafka topic, or a key
    /// in the Redis the `[redis]` sink writes to.
    pub store: StoreKind,
    /// `store = "file"`: the directory of `<name>.json`; it must exist (outboxd does not create
    /// it), on a persistent volume.
    pub dir: PathBuf,
    /// How often the checkpoint is written: the delay between an acknowledgement and the durable
    /// write that covers it. After a crash, what was acknowledged since the last write is sent again
    /// (with what was in flight).
    pub interval_ms: u64,
    /// `store = "kafka"`: the compacted topic holding one checkpoint record per pipeline name.
    pub topic: String,
    /// `store = "kafka"`: how long an instance that stopped answering keeps the lead (Kafka's
    /// `session.timeout.ms` for the pipeline's group); a standby takes over after about this long.
    pub takeover_timeout_ms: u64,
}

/// `checkpoint.store`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    File,
    Kafka,
    /// In the `[redis]` sink's server, committed with the entries (exactly-once).
    Redis,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            store: StoreKind::File,
            dir: PathBuf::from("checkpoints"),
            interval_ms: 50,
            topic: "outboxd.checkpoints".into(),
            takeover_timeout_ms: 6_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// `host:port` for /metrics, /healthz, /readyz; empty disables the server.
    pub listen: String,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: "127.0.0.1:9187".into(),
        }
    }
}

impl Config {
    /// Reads the file at `path`, applies `OUTBOXD_*` overrides from the process environment, validates.
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::config(format!("cannot read config file {}: {e}", path.display())).remedy(
                "pass the file with --config PATH or OUTBOXD_CONFIG, or create ./outboxd.toml",
            )
        })?;
        Self::from_toml_with_env(&text, &path.display().to_string(), std::env::vars())
    }

    /// Parses `text` (named `origin` in errors), applies the given `OUTBOXD_*` variables, validates.
    pub fn from_toml_with_env(
        text: &str,
        origin: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config> {
        // toml's own message quotes the offending line, which may hold a password: name the
        // line and the problem only.
        let mut doc: toml::Table = toml::from_str(text).map_err(|e: toml::de::Error| {
            let line = e
                .span()
                .map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1);
            let at = line.map(|l| format!(" at line {l}")).unwrap_or_default();
            Error::config(format!("{origin} is not valid TOML{at}: {}", e.message()))
                .remedy("fix the syntax at the line named")
        })?;
        apply_env_overrides(&mut doc, env)?;
        // Before anything can fail on a value: a type error quotes it.
        crate::secrets::register(secrets_in(&doc));
        let mut config: Config = serde_path_to_error::deserialize(toml::Value::Table(doc))
            .map_err(|e| {
                let path = e.path().to_string();
                Error::config(format!("{origin}: key `{path}`: {}", e.into_inner())).remedy(
                    "correct or remove that key (docs/reference/configuration.md lists every key)",
                )
            })?;
        if let Some(kafka) = config.kafka.as_mut() {
            kafka.normalize()?;
        }
        config.validate()?;
        // Now also what only the whole config knows (a password file's content).
        crate::secrets::register(config.secret_values());
        Ok(config)
    }

    fn validate(&self) -> Result<()> {
        let bad = |key: &str, why: String, fix: &str| {
            Err(Error::config(format!("key `{key}`: {why}")).remedy(fix.to_string()))
        };
        if self.name.is_empty()
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            || self.name.starts_with('.')
        {
            return bad(
                "name",
                format!("{:?} cannot name a checkpoint file", self.name),
                "use letters, digits, '-', '_' or '.' (e.g. name = \"orders\")",
            );
        }
        self.source.validate()?;
        if let Some(prune) = &self.prune {
            prune.settings(&self.source)?;
        }
        if let Err((key, why, fix)) = self.route.validate() {
            return bad(&key, why, &fix);
        }
        for (key, value) in [
            ("route.by", &self.route.by),
            ("route.key", &self.route.key),
            ("route.payload", &self.route.payload),
            ("route.id", &self.route.id),
        ] {
            if value.is_empty() {
                return bad(
                    key,
                    "empty column name".into(),
                    "name a column of the outbox table",
                );
            }
        }
        let sink = self.sink_section()?;
        if let Err((key, why, fix)) =
            sink.validate(&self.route, self.checkpoint.store == StoreKind::Kafka)
        {
            return bad(&key, why, &fix);
        }
        if self.checkpoint.store == StoreKind::Kafka && !matches!(sink, SinkConfig::Kafka(_)) {
            return bad(
                "checkpoint.store",
                "the Kafka checkpoint store writes to the [kafka] section's brokers, and this pipeline has none".into(),
                "use checkpoint.store = \"file\" (the default) with this sink",
            );
        }
        if self.checkpoint.store == StoreKind::Redis && !matches!(sink, SinkConfig::Redis(_)) {
            return bad(
                "checkpoint.store",
                "the Redis checkpoint store lives in the [redis] sink's server (it is committed with the entries), and this pipeline has none".into(),
                "use checkpoint.store = \"file\" (the default) with this sink",
            );
        }
        for header in self.route.headers.keys() {
            if header == crate::route::ID_HEADER || header.starts_with("outboxd.") {
                return bad(
                    &format!("route.headers.{header}"),
                    format!("outboxd writes the {header} header itself; a second one would confuse consumers"),
                    "to take the id from another column set route.id; pick another header name otherwise",
                );
            }
        }
        if self.checkpoint.interval_ms == 0 {
            return bad(
                "checkpoint.interval_ms",
                "0 would fsync on every ack".into(),
                "use a positive number of milliseconds (default 50)",
            );
        }
        if self.checkpoint.store == StoreKind::Kafka {
            if let Err(why) = crate::route::validate_topic_name(&self.checkpoint.topic) {
                return bad(
                    "checkpoint.topic",
                    why,
                    "use a valid Kafka topic name (default \"outboxd.checkpoints\")",
                );
            }
            if !(1_000..=300_000).contains(&self.checkpoint.takeover_timeout_ms) {
                return bad(
                    "checkpoint.takeover_timeout_ms",
                    format!("{} is out of range", self.checkpoint.takeover_timeout_ms),
                    "use 1000..=300000 milliseconds (default 6000; the brokers' group.min.session.timeout.ms is the real floor)",
                );
            }
        }
        if !self.http.listen.is_empty() && self.http.listen.parse::<SocketAddr>().is_err() {
            return bad(
                "http.listen",
                format!("{:?} is not host:port", self.http.listen),
                "use e.g. \"127.0.0.1:9187\", or \"\" to disable",
            );
        }
        Ok(())
    }

    /// Every secret value this configuration holds: the database password (setting, file or URL,
    /// plain and decoded) and the values of librdkafka properties that carry credentials. For
    /// [`crate::secrets::register`].
    pub fn secret_values(&self) -> Vec<String> {
        let mut secrets = Vec::new();
        if let Ok(Some(p)) = self.source.password() {
            secrets.push(p);
        }
        secrets.extend(url_secrets(&self.source.url));
        if let SourceDb::Postgres(own) = &self.source.db {
            secrets.extend(own.primary_url.iter().flat_map(|u| url_secrets(u)));
        }
        if let Some(url) = self.prune.as_ref().and_then(|p| p.url.as_deref()) {
            secrets.extend(url_secrets(url));
        }
        for sink in self.sink_sections() {
            secrets.extend(sink.secret_values());
        }
        secrets
    }

    /// The one sink section (validated: exactly one is present).
    pub fn sink(&self) -> SinkConfig<'_> {
        self.sink_section()
            .expect("a validated config has exactly one sink section")
    }

    /// What every sink shares: the window, the drain deadline, the dead-letter destination.
    pub fn delivery(&self) -> Delivery {
        self.sink().delivery()
    }

    /// `[kafka]` when it is the sink (the Kafka checkpoint store and exactly-once need it).
    pub fn kafka(&self) -> Option<&KafkaConfig> {
        self.kafka.as_ref()
    }

    /// Every sink section present (a valid config has one).
    fn sink_sections(&self) -> Vec<SinkConfig<'_>> {
        [
            self.kafka.as_ref().map(SinkConfig::Kafka),
            self.rabbitmq.as_ref().map(SinkConfig::RabbitMq),
            self.nats.as_ref().map(SinkConfig::Nats),
            self.redis.as_ref().map(SinkConfig::Redis),
            self.sqs.as_ref().map(SinkConfig::Sqs),
            self.sns.as_ref().map(SinkConfig::Sns),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    fn sink_section(&self) -> Result<SinkConfig<'_>> {
        let present = self.sink_sections();
        match present.as_slice() {
            [one] => Ok(*one),
            [] => Err(Error::config("no sink section: outboxd has nowhere to send the rows")
                .remedy("add one of [kafka] (brokers = \"host:9092\"), [rabbitmq] (url, exchange), [nats] (url), [redis] (url), [sqs] or [sns] (region); docs/reference/configuration.md")),
            many => Err(Error::config(format!(
                "{} sink sections ({}): outboxd sends each pipeline to exactly one",
                many.len(),
                many.iter().map(|s| format!("[{}]", s.name())).collect::<Vec<_>>().join(", ")
            ))
            .remedy("keep one of them; run one outboxd per destination")),
        }
    }

    /// Path of the live checkpoint file.
    pub fn checkpoint_path(&self) -> PathBuf {
        self.checkpoint.dir.join(format!("{}.json", self.name))
    }
}

/// Secret values in a parsed but not yet validated config (see [`Config::secret_values`]), in
/// whatever TOML type they were written.
fn secrets_in(doc: &toml::Table) -> Vec<String> {
    let text = |v: &toml::Value| match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut secrets = Vec::new();
    let section = |name: &str| doc.get(name).and_then(toml::Value::as_table);
    if let Some(source) = section("source") {
        if let Some(p) = source.get("password") {
            secrets.push(text(p));
        }
        for key in ["url", "primary_url"] {
            if let Some(url) = source.get(key).and_then(toml::Value::as_str) {
                secrets.extend(url_secrets(url));
            }
        }
    }
    if let Some(url) = section("prune")
        .and_then(|p| p.get("url"))
        .and_then(toml::Value::as_str)
    {
        secrets.extend(url_secrets(url));
    }
    for sink in ["rabbitmq", "nats", "redis", "sqs", "sns"] {
        for (key, value) in section(sink).into_iter().flatten() {
            match value.as_str() {
                Some(urls) if key == "url" && sink == "nats" => {
                    secrets.extend(crate::sink::nats::config::url_secrets(urls))
                }
                Some(url) if key == "url" || key == "endpoint_url" => {
                    secrets.extend(url_secrets(url))
                }
                _ if is_secret_key(key) => secrets.push(text(value)),
                _ => {}
            }
        }
    }
    if let Some(properties) = section("kafka")
        .and_then(|k| k.get("properties"))
        .and_then(toml::Value::as_table)
    {
        for (key, value) in properties {
            if is_secret_key(key) {
                secrets.push(text(value));
            }
        }
    }
    secrets
}

/// Top-level sections an `OUTBOXD_` variable may address; other `OUTBOXD_*` variables (a platform's
/// service links, the test rig's own) are not configuration and are left alone.
pub(crate) const TOP_LEVEL: [&str; 12] = [
    "name",
    "source",
    "route",
    "kafka",
    "rabbitmq",
    "nats",
    "redis",
    "sqs",
    "sns",
    "checkpoint",
    "http",
    "prune",
];
/// Keys whose values are numbers, booleans or lists: their override is read as a TOML literal.
/// The schema says which those are; a test holds this list to it.
const TYPED_KEYS: [&str; 30] = [
    "server_id",
    "snapshot_chunk",
    "additional",
    "expand_json_payload",
    "tombstone_on_empty_payload",
    "exactly_once",
    "max_timestamp_ahead_ms",
    "allow_lossy_streams",
    "ordered",
    "takeover_timeout_ms",
    "batch",
    "partitions_ahead",
    "transaction_interval_ms",
    "transaction_max_records",
    "transaction_max_bytes",
    "maxlen",
    "wait_replicas",
    "max_message_bytes",
    "max_batches_in_flight",
    "message_timeout_ms",
    "heartbeat_interval_ms",
    "max_in_flight",
    "max_in_flight_bytes",
    "drain_timeout_ms",
    "interval_ms",
    "tables",
    "message_prefixes",
    "headers",
    "tls",
    "properties",
];
/// Sections whose keys are free names (header names, librdkafka properties): kept as written.
const MAP_SECTIONS: [&str; 2] = ["headers", "properties"];

fn apply_env_overrides(
    doc: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<()> {
    let mut vars: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX) && k != CONFIG_ENV)
        .filter(|(k, _)| {
            let first = k[ENV_PREFIX.len()..].split("__").next().unwrap_or("");
            TOP_LEVEL.contains(&first.to_ascii_lowercase().as_str())
        })
        .collect();
    vars.sort();
    for (key, raw) in vars {
        let mut path: Vec<String> = Vec::new();
        for segment in key[ENV_PREFIX.len()..].split("__") {
            let in_map = path
                .last()
                .is_some_and(|p| MAP_SECTIONS.contains(&p.as_str()));
            // Header names keep their case; librdkafka property names are lower case.
            let keep_case = in_map && path.last().is_some_and(|p| p == "headers");
            path.push(if keep_case {
                segment.to_string()
            } else {
                segment.to_ascii_lowercase()
            });
        }
        if path.iter().any(|p| p.is_empty()) {
            return Err(Error::config(format!(
                "environment variable {key} has an empty key segment"
            ))
            .remedy("separate levels with exactly two underscores, e.g. OUTBOXD_KAFKA__BROKERS"));
        }
        // Strings (passwords included) are taken verbatim, never parsed: "0123" stays "0123",
        // quotes stay quotes. Only keys that hold numbers or lists are read as TOML literals.
        let last = &path[path.len() - 1];
        let typed = TYPED_KEYS.contains(&last.as_str())
            && !path[..path.len() - 1]
                .iter()
                .any(|p| MAP_SECTIONS.contains(&p.as_str()));
        let value = if typed {
            parse_env_value(&raw)
        } else {
            toml::Value::String(raw)
        };
        let mut table = &mut *doc;
        for segment in &path[..path.len() - 1] {
            let entry = table
                .entry(segment.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = match entry {
                toml::Value::Table(t) => t,
                _ => {
                    return Err(Error::config(format!(
                        "environment variable {key}: `{segment}` is not a section"
                    ))
                    .remedy("check the key path against the configuration reference"))
                }
            };
        }
        table.insert(last.clone(), value);
    }
    Ok(())
}

fn parse_env_value(raw: &str) -> toml::Value {
    #[derive(Deserialize)]
    struct Wrapper {
        v: toml::Value,
    }
    match toml::from_str::<Wrapper>(&format!("v = {raw}")) {
        Ok(w) => w.v,
        Err(_) => toml::Value::String(raw.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
name = "orders"
[source]
kind = "mysql"
url = "mysql://cdc@127.0.0.1:3306/app"
tables = ["app.outbox"]
[kafka]
brokers = "127.0.0.1:9092"
"#;

    fn parse(text: &str, env: &[(&str, &str)]) -> Result<Config> {
        Config::from_toml_with_env(
            text,
            "test.toml",
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }

    #[test]
    fn defaults_follow_debezium() {
        let c = parse(MINIMAL, &[]).unwrap();
        assert_eq!(c.route.by, "aggregatetype");
        assert_eq!(c.route.topic, "outbox.event.${routedByValue}");
        assert_eq!(c.route.key, "aggregateid");
        assert_eq!(c.route.payload, "payload");
        assert_eq!(c.route.id, "id");
        assert_eq!(c.checkpoint.interval_ms, 50);
        assert_eq!(
            c.checkpoint_path(),
            PathBuf::from("checkpoints/orders.json")
        );
        assert_eq!(c.http.listen, "127.0.0.1:9187");
        let SourceDb::Mysql(own) = &c.source.db else {
            panic!("a MySQL source")
        };
        let again = parse(MINIMAL, &[]).unwrap();
        let SourceDb::Mysql(again) = &again.source.db else {
            panic!("a MySQL source")
        };
        assert_eq!(own.server_id(&c.name), again.server_id(&c.name));
        assert!(own.server_id(&c.name) >= 1_000_000);
    }

    #[test]
    fn the_whole_design_schema_parses() {
        let text = r#"
name = "orders"
[source]
kind = "postgres"
url = "postgres://cdc@127.0.0.1:5432/app"
password_file = "/run/secrets/db"
tables = ["public.outbox", "billing.outbox"]
server_id = 4242
tls = { mode = "verify-full", ca = "/etc/outboxd/ca.pem" }
slot = "s1"
publication = "p1"
message_prefixes = ["outbox"]
primary_url = "postgres://cdc@pg1:5432/app"
heartbeat_interval_ms = 1000
[route]
by = "topic"
topic = "events.${routedByValue}"
key = "k"
payload = "event"
id = "uuid"
headers = { eventType = "type" }
[kafka]
brokers = "a:9092,b:9092"
dead_letter_topic = "outboxd.dlq.orders"
max_in_flight = 500
[kafka.properties]
"compression.type" = "zstd"
[checkpoint]
dir = "/var/lib/outboxd"
interval_ms = 200
[http]
listen = ""
"#;
        let c = parse(text, &[]).unwrap();
        assert_eq!(c.source.kind(), SourceKind::Postgres);
        // The MySQL-only key is kept apart and named, not used.
        assert_eq!(
            c.source.unused_keys(),
            ["source.server_id does not apply to a postgres source and is not used"]
        );
        let SourceDb::Postgres(own) = &c.source.db else {
            panic!("a Postgres source")
        };
        assert_eq!((own.slot.as_str(), own.publication.as_str()), ("s1", "p1"));
        assert_eq!(own.message_prefixes, ["outbox"]);
        assert_eq!(
            own.primary_url.as_deref(),
            Some("postgres://cdc@pg1:5432/app")
        );
        // Without parameters of its own the primary is reached with source.url's (TLS included);
        // with its own, those.
        assert_eq!(
            c.source.primary().unwrap().url,
            "postgres://cdc@pg1:5432/app"
        );
        let tls_url = text
            .replace(
                "@127.0.0.1:5432/app\"",
                "@127.0.0.1:5432/app?sslmode=verify-full&sslrootcert=/ca.pem\"",
            )
            .replace(
                "tls = { mode = \"verify-full\", ca = \"/etc/outboxd/ca.pem\" }\n",
                "",
            );
        let with_tls = parse(&tls_url, &[]).unwrap();
        assert_eq!(
            with_tls.source.primary().unwrap().url,
            "postgres://cdc@pg1:5432/app?sslmode=verify-full&sslrootcert=/ca.pem"
        );
        let own_params = tls_url.replace("@pg1:5432/app", "@pg1:5432/app?sslmode=require");
        assert_eq!(
            parse(&own_params, &[])
                .unwrap()
                .source
                .primary()
                .unwrap()
                .url,
            "postgres://cdc@pg1:5432/app?sslmode=require"
        );
        // The primary a standby follows is one server.
        let two = text.replace("@pg1:5432/app", "@pg1:5432,pg2:5432/app");
        assert!(parse(&two, &[])
            .unwrap_err()
            .to_string()
            .contains("source.primary_url"));
        assert_eq!(c.source.tls.as_ref().unwrap().mode, TlsMode::VerifyFull);
        // Certificates with TLS switched off are a mistake, not something to ignore.
        let tls = text.replace("mode = \"verify-full\"", "mode = \"disable\"");
        assert!(parse(&tls, &[])
            .unwrap_err()
            .to_string()
            .contains("source.tls"));
        assert_eq!(c.route.headers["eventType"], "type");
        assert_eq!(c.kafka().unwrap().properties["compression.type"], "zstd");
        assert_eq!(
            c.kafka().unwrap().dead_letter_topic.as_deref(),
            Some("outboxd.dlq.orders")
        );
        assert_eq!(c.http.listen, "");
    }

    #[test]
    fn snapshot_settings_are_checked_together() {
        let with = |extra: &str| MINIMAL.replace("[kafka]", &format!("{extra}\n[kafka]"));
        let c = parse(MINIMAL, &[]).unwrap();
        assert_eq!(
            c.source.snapshot,
            crate::source::config::SnapshotMode::Never
        );
        assert_eq!(c.source.snapshot_chunk, 1000);
        let c = parse(
            &with("snapshot = \"initial_where\"\nsnapshot_where = \"published = false\""),
            &[],
        )
        .unwrap();
        assert_eq!(
            c.source.snapshot_where.as_deref(),
            Some("published = false")
        );
        for (extra, named) in [
            ("snapshot = \"initial_where\"", "snapshot_where"),
            (
                "snapshot = \"initial\"\nsnapshot_where = \"x = 1\"",
                "snapshot_where",
            ),
            ("snapshot_where = \"x = 1\"", "snapshot_where"),
            (
                "snapshot = \"initial\"\nsnapshot_chunk = 0",
                "snapshot_chunk",
            ),
            ("snapshot = \"always\"", "snapshot"),
        ] {
            let err = parse(&with(extra), &[]).unwrap_err().to_string();
            assert!(err.contains(named), "{extra}: {err}");
        }
    }

    #[test]
    fn unknown_key_is_named() {
        let text = MINIMAL.replace("[kafka]", "[kafka]\nbrokerz = \"x\"");
        let err = parse(&text, &[]).unwrap_err().to_string();
        assert!(err.contains("brokerz"), "{err}");
        let text = MINIMAL.replace("[source]", "[source]\nserver-id = 5");
        let err = parse(&text, &[]).unwrap_err().to_string();
        assert!(err.contains("server-id") && err.contains("source"), "{err}");
    }

    #[test]
    fn env_overrides_nested_keys_with_types() {
        let c = parse(
            MINIMAL,
            &[
                ("OUTBOXD_KAFKA__BROKERS", "10.0.0.1:9092"),
                ("OUTBOXD_KAFKA__MAX_IN_FLIGHT", "7"),
                ("OUTBOXD_KAFKA__DEAD_LETTER_TOPIC", "dlq"),
                ("OUTBOXD_SOURCE__TABLES", r#"["a.b", "c.d"]"#),
                ("OUTBOXD_SOURCE__PASSWORD", "s3cr:et@"),
                ("OUTBOXD_CHECKPOINT__INTERVAL_MS", "9"),
                ("OUTBOXD_CONFIG", "ignored.toml"),
                ("UNRELATED", "x"),
            ],
        )
        .unwrap();
        assert_eq!(c.kafka().unwrap().brokers, "10.0.0.1:9092");
        assert_eq!(c.kafka().unwrap().max_in_flight, 7);
        assert_eq!(c.kafka().unwrap().dead_letter_topic.as_deref(), Some("dlq"));
        assert_eq!(c.source.tables, vec!["a.b", "c.d"]);
        assert_eq!(c.source.password().unwrap().as_deref(), Some("s3cr:et@"));
        assert_eq!(c.checkpoint.interval_ms, 9);
        assert!(!format!("{:?}", c.source).contains("s3cr"));
    }

    /// The override rules follow the schema: every section can be addressed (the reference lists
    /// TOP_LEVEL's sections and fails on one the schema has beyond them), and every key whose
    /// value is not text is read as a literal (else `OUTBOXD_KAFKA__EXACTLY_ONCE=true` would be
    /// the string "true", refused).
    #[test]
    fn env_overrides_reach_every_section_and_read_every_non_text_key_as_a_literal() {
        // typed_paths walks every section of the schema, and panics on one TOP_LEVEL lacks.
        let untyped: Vec<String> = crate::reference::config::typed_paths()
            .into_iter()
            .filter(|path| {
                let last = path.rsplit(['.', ']']).next().unwrap_or(path);
                !TYPED_KEYS.contains(&last)
            })
            .collect();
        assert!(
            untyped.is_empty(),
            "add these keys' names to config::TYPED_KEYS: {untyped:?}"
        );
        let c = parse(
            &format!("{MINIMAL}[checkpoint]\nstore = \"kafka\"\n[prune]\n"),
            &[
                ("OUTBOXD_KAFKA__EXACTLY_ONCE", "true"),
                ("OUTBOXD_PRUNE__OLDER_THAN", "2h"),
                ("OUTBOXD_PRUNE__BATCH", "50"),
            ],
        )
        .unwrap();
        assert!(c.kafka().unwrap().exactly_once);
        let prune = c.prune.as_ref().unwrap();
        assert_eq!((prune.older_than.as_str(), prune.batch), ("2h", 50));
    }

    #[test]
    fn env_strings_stay_verbatim_and_foreign_variables_are_ignored() {
        let c = parse(
            MINIMAL,
            &[
                ("OUTBOXD_SOURCE__PASSWORD", "123456"),
                ("OUTBOXD_KAFKA__PROPERTIES__sasl.password", "\"quoted\""),
                ("OUTBOXD_KAFKA__PROPERTIES__linger.ms", "5"),
                ("OUTBOXD_ROUTE__HEADERS__eventType", "type"),
                ("OUTBOXD_NAME", "007"),
                ("OUTBOXD_TEST_BROKER", "/somewhere"),
                ("OUTBOXD_ORDERS_SERVICE_HOST", "10.0.0.1"),
            ],
        )
        .unwrap();
        assert_eq!(c.source.password().unwrap().as_deref(), Some("123456"));
        assert_eq!(c.kafka().unwrap().properties["sasl.password"], "\"quoted\"");
        assert_eq!(c.kafka().unwrap().properties["linger.ms"], "5");
        assert_eq!(c.route.headers["eventType"], "type");
        assert_eq!(c.name, "007");
    }

    #[test]
    fn env_override_with_unknown_key_is_an_error() {
        let err = parse(MINIMAL, &[("OUTBOXD_KAFKA__BROKER", "x")]).unwrap_err();
        assert!(err.to_string().contains("kafka.broker"), "{err}");
    }

    #[test]
    fn invalid_values_name_the_key_and_the_fix() {
        for (from, to, key) in [
            (
                "tables = [\"app.outbox\"]",
                "tables = [\"outbox\"]",
                "source.tables",
            ),
            ("tables = [\"app.outbox\"]", "tables = []", "source.tables"),
            ("name = \"orders\"", "name = \"a/b\"", "name"),
            ("url = \"mysql://", "url = \"postgres://", "source.url"),
            (
                "brokers = \"127.0.0.1:9092\"",
                "brokers = \"\"",
                "kafka.brokers",
            ),
        ] {
            let err = parse(&MINIMAL.replace(from, to), &[]).unwrap_err();
            assert!(err.to_string().contains(key), "{key}: {err}");
            assert!(err.remedy_text().is_some(), "{key}: no remedy");
        }
        let text = format!("{MINIMAL}[kafka.properties]\nacks = \"1\"\n");
        let err = parse(&text, &[]).unwrap_err();
        assert!(err.to_string().contains("kafka.properties.acks"), "{err}");
        // A route header named like one outboxd writes would duplicate it.
        for header in ["id", "outboxd.position"] {
            let text = format!("{MINIMAL}[route.headers]\n\"{header}\" = \"type\"\n");
            let err = parse(&text, &[]).unwrap_err();
            assert!(
                err.to_string().contains(&format!("route.headers.{header}")),
                "{err}"
            );
            assert!(err.remedy_text().unwrap().contains("route.id"), "{err}");
        }
    }

    #[test]
    fn the_shipped_configs_parse() {
        let mut sinks = std::collections::BTreeSet::new();
        for (name, text) in [
            (
                "outboxd.example.toml",
                include_str!("../deploy/outboxd.example.toml"),
            ),
            (
                "outboxd-rabbitmq.example.toml",
                include_str!("../deploy/outboxd-rabbitmq.example.toml"),
            ),
            (
                "outboxd-nats.example.toml",
                include_str!("../deploy/outboxd-nats.example.toml"),
            ),
            (
                "outboxd-redis.example.toml",
                include_str!("../deploy/outboxd-redis.example.toml"),
            ),
            (
                "outboxd-sqs.example.toml",
                include_str!("../deploy/outboxd-sqs.example.toml"),
            ),
            (
                "compose/outboxd-mysql.toml",
                include_str!("../deploy/compose/outboxd-mysql.toml"),
            ),
            (
                "compose/outboxd-postgres.toml",
                include_str!("../deploy/compose/outboxd-postgres.toml"),
            ),
            (
                "compose/outboxd-mysql-rabbitmq.toml",
                include_str!("../deploy/compose/outboxd-mysql-rabbitmq.toml"),
            ),
            (
                "compose/outboxd-mysql-nats.toml",
                include_str!("../deploy/compose/outboxd-mysql-nats.toml"),
            ),
            (
                "compose/outboxd-mysql-redis.toml",
                include_str!("../deploy/compose/outboxd-mysql-redis.toml"),
            ),
        ] {
            match parse(text, &[]) {
                Ok(config) => {
                    sinks.insert(config.sink().name());
                }
                Err(e) => panic!("deploy/{name}: {e}"),
            }
        }
        // The SQS example's own note: rename [sqs] to [sns], queue_url to topic_arn.
        let sns = include_str!("../deploy/outboxd-sqs.example.toml")
            .replace("[sqs]", "[sns]")
            .replace("# queue_url", "# topic_arn");
        sinks.insert(parse(&sns, &[]).unwrap().sink().name());
        // Every sink has an example, and the names the metrics' `sink` label takes are the sections'.
        assert_eq!(
            sinks,
            crate::sink::SINK_NAMES
                .into_iter()
                .collect::<std::collections::BTreeSet<_>>()
        );
        for (k8s, store) in [
            (
                include_str!("../deploy/kubernetes/outboxd.yaml"),
                StoreKind::File,
            ),
            (
                include_str!("../deploy/kubernetes/outboxd-kafka-checkpoint.yaml"),
                StoreKind::Kafka,
            ),
        ] {
            let start = k8s.find("outboxd.toml: |").unwrap() + "outboxd.toml: |".len();
            let end = k8s[start..].find("---").unwrap() + start;
            let embedded: String = k8s[start..end]
                .lines()
                .map(|l| l.strip_prefix("    ").unwrap_or(l))
                .collect::<Vec<_>>()
                .join("\n");
            assert_eq!(parse(&embedded, &[]).unwrap().checkpoint.store, store);
        }
    }

    #[test]
    fn kafka_checkpoint_settings_are_checked_by_name() {
        let kafka = format!("{MINIMAL}[checkpoint]\nstore = \"kafka\"\n");
        let c = parse(&kafka, &[]).unwrap();
        assert_eq!(c.checkpoint.topic, "outboxd.checkpoints");
        assert_eq!(c.checkpoint.takeover_timeout_ms, 6000);
        for (extra, named) in [
            ("topic = \"bad topic\"\n", "checkpoint.topic"),
            (
                "takeover_timeout_ms = 10\n",
                "checkpoint.takeover_timeout_ms",
            ),
        ] {
            let err = parse(&format!("{kafka}{extra}"), &[]).unwrap_err();
            assert!(err.to_string().contains(named), "{extra}: {err}");
        }
        let err = parse(&format!("{MINIMAL}[checkpoint]\nstore = \"s3\"\n"), &[]).unwrap_err();
        assert!(err.to_string().contains("store"), "{err}");
    }

    #[test]
    fn exactly_once_needs_the_kafka_store_and_sane_transaction_limits() {
        let eos = MINIMAL.replace("[kafka]\n", "[kafka]\nexactly_once = true\n");
        let err = parse(&eos, &[]).unwrap_err();
        assert!(err.to_string().contains("kafka.exactly_once"), "{err}");
        assert!(
            err.remedy_text().unwrap().contains("store = \"kafka\""),
            "{err:?}"
        );
        let kafka = format!("{eos}[checkpoint]\nstore = \"kafka\"\n");
        let c = parse(&kafka, &[]).unwrap();
        assert!(c.kafka().unwrap().exactly_once);
        assert_eq!(c.kafka().unwrap().transaction_interval_ms, 100);
        assert_eq!(c.kafka().unwrap().transaction_max_records, 200_000);
        assert_eq!(c.kafka().unwrap().transaction_max_bytes, 128 * 1024 * 1024);
        for (extra, named) in [
            (
                "transaction_interval_ms = 0\n",
                "kafka.transaction_interval_ms",
            ),
            (
                "transaction_max_records = 0\n",
                "kafka.transaction_max_records",
            ),
            (
                "transaction_interval_ms = 40000\n",
                "kafka.transaction_interval_ms",
            ),
            (
                "transaction_max_bytes = 10\n",
                "kafka.transaction_max_bytes",
            ),
        ] {
            let text = kafka.replace("[kafka]\n", &format!("[kafka]\n{extra}"));
            let err = parse(&text, &[]).unwrap_err();
            assert!(err.to_string().contains(named), "{extra}: {err}");
        }
        let short_timeout = kafka.replace("[kafka]\n", "[kafka]\ntransaction_interval_ms = 200\n")
            + "[kafka.properties]\n\"transaction.timeout.ms\" = \"300\"\n";
        let err = parse(&short_timeout, &[]).unwrap_err();
        assert!(
            err.to_string().contains("kafka.transaction_interval_ms"),
            "{err}"
        );
    }

    #[test]
    fn kafka_secrets_are_not_in_debug_output() {
        let text = format!(
            "{MINIMAL}[kafka.properties]\n\"sasl.password\" = \"hunter2\"\n\"linger.ms\" = \"5\"\n"
        );
        let c = parse(&text, &[]).unwrap();
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("hunter2") && shown.contains("linger.ms"),
            "{shown}"
        );
        let text =
            format!("{MINIMAL}[kafka.properties]\n\"delivery.report.only.error\" = \"true\"\n");
        assert!(parse(&text, &[]).is_err());
    }

    #[test]
    fn password_in_url_is_redacted_in_errors() {
        let text = MINIMAL
            .replace("mysql://cdc@", "mysql://cdc:hunter2@")
            .replace("mysql://", "pg://");
        let err = parse(&text, &[]).unwrap_err().to_string();
        assert!(!err.contains("hunter2"), "{err}");
        assert_eq!(redact_url("mysql://u:p@h:1/db"), "mysql://u:***@h:1/db");
        assert_eq!(
            redact_url("mysql://u:p@r1:3306,r2:3307/db"),
            "mysql://u:***@r1:3306,r2:3307/db"
        );
    }

    #[test]
    fn property_names_are_case_insensitive_and_the_readme_env_example_works() {
        let c = parse(
            &format!("{MINIMAL}[kafka.properties]\n\"Linger.MS\" = \"7\"\n"),
            &[("OUTBOXD_KAFKA__PROPERTIES__SASL.PASSWORD", "s3cret-value")],
        )
        .unwrap();
        assert_eq!(
            c.kafka().unwrap().properties["sasl.password"],
            "s3cret-value"
        );
        assert_eq!(c.kafka().unwrap().properties["linger.ms"], "7");
        assert!(c.secret_values().contains(&"s3cret-value".to_string()));
        // An upper-case spelling cannot slip past the properties outboxd owns.
        let err = parse(&format!("{MINIMAL}[kafka.properties]\nACKS = \"1\"\n"), &[]).unwrap_err();
        assert!(err.to_string().contains("kafka.properties.acks"), "{err}");
        let err = parse(
            &format!("{MINIMAL}[kafka.properties]\n\"linger.ms\" = \"1\"\n\"LINGER.MS\" = \"2\"\n"),
            &[],
        )
        .unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
    }

    #[test]
    fn the_delivery_timeout_alias_and_a_timeout_that_is_no_number_are_refused() {
        for (property, needle) in [
            ("\"delivery.timeout.ms\" = \"5000\"", "alias"),
            ("\"message.timeout.ms\" = \"5000ms\"", "not a number"),
        ] {
            let err =
                parse(&format!("{MINIMAL}[kafka.properties]\n{property}\n"), &[]).unwrap_err();
            assert!(err.to_string().contains(needle), "{err}");
        }
        parse(
            &format!("{MINIMAL}[kafka.properties]\n\"message.timeout.ms\" = \"5000\"\n"),
            &[],
        )
        .unwrap();
    }

    #[test]
    fn a_partitioner_that_splits_a_key_across_partitions_is_refused() {
        let err = parse(
            &format!("{MINIMAL}[kafka.properties]\npartitioner = \"random\"\n"),
            &[],
        )
        .unwrap_err();
        assert!(err.to_string().contains("per-key order"), "{err}");
        for keyed in [
            "murmur2_random",
            "consistent_random",
            "fnv1a_random",
            "murmur2",
        ] {
            parse(
                &format!("{MINIMAL}[kafka.properties]\npartitioner = \"{keyed}\"\n"),
                &[],
            )
            .unwrap();
        }
    }

    #[test]
    fn a_secret_of_the_wrong_type_is_not_quoted_by_the_type_error() {
        let text = format!("{MINIMAL}[kafka.properties]\n\"sasl.password\" = 987654321\n");
        let err = parse(&text, &[]).unwrap_err().to_string();
        assert!(err.contains("sasl.password"), "{err}");
        assert!(!crate::secrets::scrub(&err).contains("987654321"), "{err}");
    }

    #[test]
    fn a_toml_syntax_error_names_the_line_without_quoting_it() {
        let text =
            format!("{MINIMAL}[kafka.properties]\n\"sasl.password\" = \"hunter2-unterminated\n");
        let err = parse(&text, &[]).unwrap_err().to_string();
        assert!(!err.contains("hunter2"), "{err}");
        assert!(err.contains("line 10"), "{err}");
    }

    #[test]
    fn secret_query_parameters_are_redacted() {
        assert_eq!(
            redact_url("postgres://u@h:1/db?application_name=x&password=hunter2"),
            "postgres://u@h:1/db?application_name=x&password=***"
        );
        let c = parse(&MINIMAL.replace("mysql://cdc@", "mysql://cdc:p%40ss@"), &[]).unwrap();
        let secrets = c.secret_values();
        assert!(secrets.contains(&"p%40ss".to_string()) && secrets.contains(&"p@ss".to_string()));
    }

    #[test]
    fn a_url_may_list_several_hosts() {
        assert_eq!(
            source_urls("mysql://cdc:pw@r1:3306,r2/app?x=1"),
            vec![
                "mysql://cdc:pw@r1:3306/app?x=1",
                "mysql://cdc:pw@r2/app?x=1"
            ]
        );
        assert_eq!(source_urls("mysql://h:1/db"), vec!["mysql://h:1/db"]);
        let text = MINIMAL.replace("127.0.0.1:3306", "r1:3306,r2:3306");
        assert!(parse(&text, &[]).is_ok());
        let pg = MINIMAL
            .replace("mysql://cdc@127.0.0.1:3306", "postgres://cdc@a:1,b:2")
            .replace("kind = \"mysql\"", "kind = \"postgres\"");
        // A Postgres primary and its standbys.
        let pg = parse(&pg, &[]).unwrap();
        assert_eq!(pg.source.urls().len(), 2);
    }

    const RABBIT: &str = r#"
name = "orders"
[source]
kind = "mysql"
url = "mysql://cdc@127.0.0.1:3306/app"
tables = ["app.outbox"]
[rabbitmq]
url = "amqp://outboxd:s3cret-rabbit@127.0.0.1:5672/%2f"
exchange = "outbox"
"#;

    #[test]
    fn exactly_one_sink_section_is_required_and_named() {
        let c = parse(RABBIT, &[]).unwrap();
        assert_eq!(c.sink().name(), "rabbitmq");
        assert!(c.kafka().is_none());
        let d = c.delivery();
        assert_eq!(
            d.max_in_flight,
            crate::sink::rabbitmq::config::DEFAULT_MAX_IN_FLIGHT
        );
        assert_eq!(d.drain_timeout_ms, 30_000);
        assert_eq!(d.timeout, Some(std::time::Duration::from_secs(60)));
        let both = format!("{RABBIT}[kafka]\nbrokers = \"k:9092\"\n");
        let e = parse(&both, &[]).unwrap_err().to_string();
        assert!(e.contains("2 sink sections ([kafka], [rabbitmq])"), "{e}");
        let none = MINIMAL.replace("[kafka]\nbrokers = \"127.0.0.1:9092\"\n", "");
        let e = parse(&none, &[]).unwrap_err().to_string();
        assert!(
            e.contains("no sink section") && e.contains("[rabbitmq]"),
            "{e}"
        );
    }

    #[test]
    fn rabbitmq_settings_are_checked_by_name_and_its_password_is_a_secret() {
        let bad = |extra: &str, key: &str| {
            let text = format!("{RABBIT}{extra}\n");
            let e = parse(&text, &[]).unwrap_err().to_string();
            assert!(e.contains(key), "{extra}: {e}");
            assert!(!e.contains("s3cret-rabbit"), "{e}");
        };
        bad("max_in_flight = 0", "rabbitmq.max_in_flight");
        bad("drain_timeout_ms = 0", "rabbitmq.drain_timeout_ms");
        bad("max_message_bytes = 10", "rabbitmq.max_message_bytes");
        bad("dead_letter_topic = \"\"", "rabbitmq.dead_letter_topic");
        bad("ca_file = \"/ca.pem\"", "rabbitmq.ca_file");
        bad("exactly_once = true", "exactly_once");
        let http = RABBIT.replace("amqp://", "http://");
        let e = parse(&http, &[]).unwrap_err().to_string();
        assert!(
            e.contains("rabbitmq.url") && !e.contains("s3cret-rabbit"),
            "{e}"
        );
        let kafka_store = format!("{RABBIT}[checkpoint]\nstore = \"kafka\"\n");
        let e = parse(&kafka_store, &[]).unwrap_err().to_string();
        assert!(e.contains("checkpoint.store"), "{e}");
        let c = parse(RABBIT, &[]).unwrap();
        assert!(c.secret_values().contains(&"s3cret-rabbit".to_string()));
        assert!(!format!("{c:?}").contains("s3cret-rabbit"));
        let c = parse(RABBIT, &[("OUTBOXD_RABBITMQ__MESSAGE_TIMEOUT_MS", "0")]).unwrap();
        assert_eq!(c.delivery().timeout, None);
    }

    const SQS: &str = r#"
name = "orders"
[source]
kind = "mysql"
url = "mysql://cdc@127.0.0.1:3306/app"
tables = ["app.outbox"]
[route]
topic = "outbox-${routedByValue}.fifo"
[sqs]
region = "eu-west-1"
endpoint_url = "https://u:s3cret-endpoint@sqs.example"
"#;

    #[test]
    fn sqs_and_sns_settings_are_checked_by_name_and_their_header_budget_is_enforced() {
        let c = parse(SQS, &[("OUTBOXD_SQS__MAX_BATCHES_IN_FLIGHT", "3")]).unwrap();
        assert_eq!(c.sink().name(), "sqs");
        let Some(sqs) = &c.sqs else { unreachable!() };
        assert_eq!(sqs.max_batches_in_flight, 3);
        // A window of 1,000, and no session watchdog: each lane times its messages from their
        // first send.
        assert_eq!(c.delivery().max_in_flight, 1_000);
        assert_eq!(c.delivery().timeout, None);
        assert!(c.secret_values().contains(&"s3cret-endpoint".to_string()));
        let sns = SQS.replace("[sqs]", "[sns]");
        assert_eq!(parse(&sns, &[]).unwrap().sink().name(), "sns");
        let bad = |text: &str, key: &str| {
            let e = parse(text, &[]).unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
            assert!(!e.contains("s3cret-endpoint"), "{e}");
        };
        bad(
            &format!("{SQS}message_timeout_ms = 300000\n"),
            "sqs.message_timeout_ms",
        );
        bad(
            &format!("{SQS}max_batches_in_flight = 0\n"),
            "sqs.max_batches_in_flight",
        );
        bad(
            &format!("{SQS}dead_letter_topic = \"a.b\"\n"),
            "sqs.dead_letter_topic",
        );
        bad(
            &format!("{SQS}queue_url = \"https://sqs/q\"\n"),
            "sqs.queue_url",
        );
        bad(
            &format!("{SQS}topic_arn = \"arn:x:${{topic}}\"\n"),
            "sqs.topic_arn",
        );
        bad(
            &sns.replace("[sns]", "[sns]\nqueue_url = \"https://q/${topic}\""),
            "sns.queue_url",
        );
        bad(
            &SQS.replace("https://u:s3cret", "ftp://u:s3cret"),
            "sqs.endpoint_url",
        );
        bad(
            &format!("{SQS}[route.headers]\n\"AWS.x\" = \"tenant\"\n"),
            "route.headers.AWS.x",
        );
        // Ten attributes at most: outboxd may add six, so four header columns fit, five do not.
        let headers = |n: usize| {
            let mut text = format!("{SQS}[route.headers]\n");
            for i in 0..n {
                text.push_str(&format!("h{i} = \"c{i}\"\n"));
            }
            text
        };
        assert!(parse(&headers(4), &[]).is_ok());
        bad(&headers(5), "route.headers");
    }

    const NATS: &str = r#"
name = "orders"
[source]
kind = "mysql"
url = "mysql://cdc@127.0.0.1:3306/app"
tables = ["app.outbox"]
[nats]
url = "nats://s3cret-nats-token@127.0.0.1:4222,nats://u:s3cret-nats-pw@10.0.0.2"
"#;

    #[test]
    fn nats_settings_are_checked_by_name_and_its_tokens_and_passwords_are_secrets() {
        let c = parse(NATS, &[]).unwrap();
        assert_eq!(c.sink().name(), "nats");
        assert_eq!(
            c.delivery().timeout,
            Some(std::time::Duration::from_secs(30))
        );
        let Some(nats) = &c.nats else { unreachable!() };
        let (servers, _) = nats.servers().unwrap();
        let shown: Vec<String> = servers.iter().map(|u| u.to_string()).collect();
        assert_eq!(shown, ["nats://127.0.0.1:4222", "nats://10.0.0.2:4222"]);
        let secrets = c.secret_values();
        for secret in ["s3cret-nats-token", "s3cret-nats-pw"] {
            assert!(secrets.contains(&secret.to_string()), "{secret}");
            assert!(!format!("{c:?}").contains(secret), "{c:?}");
        }
        assert_eq!(
            crate::sink::nats::config::shown_url(&nats.url),
            "nats://***@127.0.0.1:4222,nats://u:***@10.0.0.2"
        );
        let bad = |extra: &str, key: &str| {
            let text = format!("{NATS}{extra}\n");
            let e = parse(&text, &[]).unwrap_err().to_string();
            assert!(e.contains(key), "{extra}: {e}");
            assert!(!e.contains("s3cret-nats"), "{e}");
        };
        bad("message_timeout_ms = 0", "nats.message_timeout_ms");
        bad("max_message_bytes = 10", "nats.max_message_bytes");
        bad("dead_letter_topic = \"a..b\"", "nats.dead_letter_topic");
        bad("dead_letter_topic = \"dlq.>\"", "nats.dead_letter_topic");
        bad("token = \"t\"\ncredentials_file = \"/c\"", "nats.token");
        bad("exactly_once = true", "exactly_once");
        let http = NATS.replace("nats://s3cret", "http://s3cret");
        let e = parse(&http, &[]).unwrap_err().to_string();
        assert!(e.contains("nats.url") && !e.contains("s3cret-nats"), "{e}");
        let header = format!("{NATS}[route.headers]\n\"bad name\" = \"tenant\"\n");
        let e = parse(&header, &[]).unwrap_err().to_string();
        assert!(e.contains("route.headers.bad name"), "{e}");
        let e = parse(&format!("{NATS}[checkpoint]\nstore = \"kafka\"\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("checkpoint.store"), "{e}");
        let c = parse(NATS, &[("OUTBOXD_NATS__TOKEN", "s3cret-env-token")]).unwrap();
        assert!(c.secret_values().contains(&"s3cret-env-token".to_string()));
    }

    const REDIS: &str = r#"
name = "orders"
[source]
kind = "mysql"
url = "mysql://cdc@127.0.0.1:3306/app"
tables = ["app.outbox"]
[redis]
url = "redis://outboxd:s3cret-redis@127.0.0.1:6379/0"
"#;

    #[test]
    fn redis_settings_are_checked_by_name_and_its_password_is_a_secret() {
        let c = parse(REDIS, &[]).unwrap();
        assert_eq!(c.sink().name(), "redis");
        assert_eq!(
            c.delivery().timeout,
            Some(std::time::Duration::from_secs(30))
        );
        assert!(c.secret_values().contains(&"s3cret-redis".to_string()));
        assert!(!format!("{c:?}").contains("s3cret-redis"));
        let bad = |extra: &str, key: &str| {
            let text = format!("{REDIS}{extra}\n");
            let e = parse(&text, &[]).unwrap_err().to_string();
            assert!(e.contains(key), "{extra}: {e}");
            assert!(!e.contains("s3cret-redis"), "{e}");
        };
        bad("maxlen = 0", "redis.maxlen");
        bad("message_timeout_ms = 0", "redis.message_timeout_ms");
        bad("max_message_bytes = 10", "redis.max_message_bytes");
        bad("dead_letter_topic = \"\"", "redis.dead_letter_topic");
        bad("ca_file = \"/ca.pem\"", "redis.ca_file");
        bad("exactly_once = true", "exactly_once");
        bad(
            "transaction_interval_ms = 5",
            "redis.transaction_interval_ms",
        );
        bad(
            "transaction_max_records = 0",
            "redis.transaction_max_records",
        );
        // The checkpoint in Redis (exactly-once) needs the Redis sink, and only it.
        let c = parse(&format!("{REDIS}[checkpoint]\nstore = \"redis\"\n"), &[]).unwrap();
        assert_eq!(c.checkpoint.store, StoreKind::Redis);
        let limits = c.sink().transaction_limits().unwrap();
        assert_eq!((limits.max_records, limits.broker_timeout), (10_000, None));
        let e = parse(&format!("{NATS}[checkpoint]\nstore = \"redis\"\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("checkpoint.store") && e.contains("[redis]"),
            "{e}"
        );
        let http = REDIS.replace("redis://", "http://");
        let e = parse(&http, &[]).unwrap_err().to_string();
        assert!(
            e.contains("redis.url") && !e.contains("s3cret-redis"),
            "{e}"
        );
        let header = format!("{REDIS}[route.headers]\npayload = \"tenant\"\n");
        let e = parse(&header, &[]).unwrap_err().to_string();
        assert!(e.contains("route.headers.payload"), "{e}");
        let c = parse(
            REDIS,
            &[
                ("OUTBOXD_REDIS__MAXLEN", "1000"),
                ("OUTBOXD_REDIS__WAIT_REPLICAS", "1"),
            ],
        )
        .unwrap();
        let Some(redis) = &c.redis else {
            unreachable!()
        };
        assert_eq!((redis.maxlen, redis.wait_replicas), (Some(1000), 1));
    }

    /// A sink this build lacks (its cargo feature off) is refused at load, naming the feature and
    /// the build command; with the feature the same section loads. It means something in both
    /// builds: the default one (every sink) and `cargo test --lib --no-default-features`, which
    /// `scripts/test.sh` runs too.
    #[test]
    fn a_sink_this_build_lacks_is_refused_naming_its_feature() {
        let sns = SQS.replace("[sqs]", "[sns]");
        for (sink, feature, text) in [
            ("rabbitmq", "rabbitmq", RABBIT),
            ("nats", "nats", NATS),
            ("redis", "redis", REDIS),
            ("sqs", "aws", SQS),
            ("sns", "aws", sns.as_str()),
        ] {
            let parsed = parse(text, &[]);
            if crate::sink::built_sinks().contains(&sink) {
                parsed.unwrap_or_else(|e| panic!("{sink}: {e}"));
                continue;
            }
            let e = parsed.expect_err(sink);
            let shown = format!("{e} {}", e.remedy_text().unwrap_or_default());
            assert!(
                shown.contains(&format!("without the `{feature}` feature"))
                    && shown.contains(&format!("--features {feature}")),
                "{shown}"
            );
        }
        assert!(crate::sink::built_sinks().contains(&"kafka"));
    }
}
