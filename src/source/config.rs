//! The `[source]` section: what every source needs (URL, credentials, tables, TLS, liveness) and,
//! apart, what only one database has ([`SourceDb`]: a MySQL replica's server id; a Postgres slot,
//! publication and message prefixes). Each source is handed only its own part; a key of the other
//! database is refused by name rather than ignored. The URL's host list and its redaction live here
//! too, so one function reads a multi-host URL and one hides its secrets.

use std::path::PathBuf;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::secrets::is_secret_key;

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum SourceKind {
    Mysql,
    Postgres,
}

impl SourceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::Mysql => "mysql",
            SourceKind::Postgres => "postgres",
        }
    }
}

/// `[source]`, validated.
#[derive(Clone, Deserialize)]
#[serde(try_from = "RawSource")]
pub struct SourceConfig {
    pub url: String,
    /// Set through `OUTBOXD_SOURCE__PASSWORD`; never logged.
    pub password: Option<String>,
    pub password_file: Option<PathBuf>,
    pub tables: Vec<String>,
    pub tls: Option<TlsConfig>,
    /// Heartbeat the server sends when idle; a stream silent for 3x this long is treated as dead.
    pub heartbeat_interval_ms: u64,
    /// What a first start (no checkpoint) sends of the rows already in the outbox tables.
    pub snapshot: SnapshotMode,
    /// `snapshot = "initial_where"`: the SQL predicate choosing the rows to send.
    pub snapshot_where: Option<String>,
    /// Rows per snapshot read (one key-ordered chunk, one checkpointed step).
    pub snapshot_chunk: usize,
    /// What only this kind of database has.
    pub db: SourceDb,
    /// Keys that were set but belong to the other kind of database (not used).
    pub other_db_keys: Vec<&'static str>,
    /// `url` is one host of several in the configured `source.url` ([`SourceConfig::with_url`]).
    pub one_of_several: bool,
}

/// `source.snapshot`: what a first start does with the rows already in the outbox tables.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, serde::Serialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotMode {
    /// Start at the log's end (rows written before are not sent).
    #[default]
    Never,
    /// Send every row already in the tables, then stream from where that read began.
    Initial,
    /// Like `initial`, for the rows matching `snapshot_where` (a polling relay's "unpublished").
    InitialWhere,
}

/// The per-database part of `[source]`.
#[derive(Debug, Clone)]
pub enum SourceDb {
    Mysql(MysqlOptions),
    Postgres(PostgresOptions),
}

#[derive(Debug, Clone, Default)]
pub struct MysqlOptions {
    /// This reader's replica server id; derived from the pipeline name when not configured.
    pub server_id: Option<u32>,
}

impl MysqlOptions {
    /// The replica server id this reader registers with (configured, or derived from `pipeline`).
    pub fn server_id(&self, pipeline: &str) -> u32 {
        self.server_id.unwrap_or_else(|| {
            // Stable across restarts, distinct per pipeline name, far from the small ids people use.
            let hash = pipeline.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
            });
            1_000_000 + (hash % 1_000_000_000) as u32
        })
    }
}

#[derive(Clone)]
pub struct PostgresOptions {
    pub slot: String,
    pub publication: String,
    pub message_prefixes: Vec<String>,
    /// Reading a standby: the primary it follows, where the heartbeat is written.
    pub primary_url: Option<String>,
}

impl std::fmt::Debug for PostgresOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresOptions")
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .field("message_prefixes", &self.message_prefixes)
            .field("primary_url", &self.primary_url.as_deref().map(redact_url))
            .finish()
    }
}

/// The schema of `[source]` is the schema of what is written ([`RawSource`]).
impl schemars::JsonSchema for SourceConfig {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "SourceConfig".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        RawSource::json_schema(generator)
    }
}

/// `[source]` as written: one flat table, so configs keep their shape.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawSource {
    /// The database: `mysql` (MySQL 5.7/8/9, MariaDB 10.5+) or `postgres` (14+).
    kind: SourceKind,
    /// The reader's user and the server: `mysql://cdc@db:3306/app` or `postgres://cdc@db:5432/app`
    /// (a replica is fine). Several hosts (`mysql://cdc@r1:3306,r2:3306/app`, or a Postgres primary
    /// and its standbys) are tried in order on failover. The password may ride in it, but `password_file` or
    /// `OUTBOXD_SOURCE__PASSWORD` keep it out of the file.
    url: String,
    /// The password (set it as `OUTBOXD_SOURCE__PASSWORD` rather than in the file); never logged.
    #[serde(default)]
    password: Option<String>,
    /// A file holding the password (a mounted secret); trailing newlines are ignored.
    #[serde(default)]
    password_file: Option<PathBuf>,
    /// The outbox tables, schema-qualified (`app.outbox`, `public.outbox`); only their INSERTs are
    /// forwarded.
    tables: Vec<String>,
    /// MySQL/MariaDB: this reader's replica server id, unique among the server's replicas;
    /// derived from `name` when unset.
    #[serde(default)]
    server_id: Option<u32>,
    /// TLS to the database (`{ mode = "verify-full", ca = "/path/ca.pem" }`); with a Postgres URL,
    /// libpq's `sslmode`/`sslrootcert` parameters work too.
    #[serde(default)]
    tls: Option<TlsConfig>,
    /// Postgres: the logical replication slot (pgoutput), created when missing. Default `outboxd`.
    #[serde(default)]
    slot: Option<String>,
    /// Postgres: the publication, created when missing as `FOR TABLE <tables> WITH (publish =
    /// 'insert', publish_via_partition_root = true)`. Default `outboxd`.
    #[serde(default)]
    publication: Option<String>,
    /// Postgres: forward logical decoding messages with these prefixes
    /// (`pg_logical_emit_message(true, 'outbox', …)`), the table-less outbox.
    #[serde(default)]
    message_prefixes: Option<Vec<String>>,
    /// Postgres, reading a standby: the primary it follows (`postgres://cdc@pg1:5432/app`, one
    /// host). A standby cannot write, so outboxd writes its heartbeat message there; it replicates
    /// to the standby and comes back through the stream, so a quiet database still shows progress
    /// (`/readyz`) and the slot keeps moving. The password is `password`/`password_file`, else its
    /// own; without parameters of its own it takes `url`'s (TLS included). Not
    /// used while `url` is a primary.
    #[serde(default)]
    primary_url: Option<String>,
    /// How often an idle stream proves it is alive (MySQL/MariaDB: the server's binlog heartbeat;
    /// Postgres: a message outboxd emits with `pg_logical_emit_message`); a stream silent for three
    /// of them is treated as dead and reconnected.
    #[serde(default = "default_heartbeat_ms")]
    heartbeat_interval_ms: u64,
    /// What a first start (no checkpoint) sends of the rows already in the outbox tables.
    #[serde(default)]
    snapshot: SnapshotMode,
    /// `snapshot = "initial_where"`: the SQL condition choosing the rows still to send
    /// (`published = false`).
    #[serde(default)]
    snapshot_where: Option<String>,
    /// Rows per snapshot read (one key-ordered chunk, one checkpointed step).
    #[serde(default = "default_snapshot_chunk")]
    snapshot_chunk: usize,
}

impl TryFrom<RawSource> for SourceConfig {
    type Error = String;

    fn try_from(raw: RawSource) -> std::result::Result<Self, String> {
        // The other database's keys are accepted (the design's example config lists both, with a
        // comment on each) but not used: `check` and `run` say so, naming each key.
        let mut other_db_keys = Vec::new();
        let db = match raw.kind {
            SourceKind::Mysql => {
                for (key, set) in [
                    ("source.slot", raw.slot.is_some()),
                    ("source.publication", raw.publication.is_some()),
                    ("source.message_prefixes", raw.message_prefixes.is_some()),
                    ("source.primary_url", raw.primary_url.is_some()),
                ] {
                    if set {
                        other_db_keys.push(key);
                    }
                }
                if raw.server_id == Some(0) {
                    return Err("0 is not a valid replica server id; pick a number unique among the server's replicas, e.g. 4242".into());
                }
                SourceDb::Mysql(MysqlOptions {
                    server_id: raw.server_id,
                })
            }
            SourceKind::Postgres => {
                if raw.server_id.is_some() {
                    other_db_keys.push("source.server_id");
                }
                SourceDb::Postgres(PostgresOptions {
                    slot: raw.slot.unwrap_or_else(default_slot),
                    publication: raw.publication.unwrap_or_else(default_slot),
                    message_prefixes: raw.message_prefixes.unwrap_or_default(),
                    primary_url: raw.primary_url,
                })
            }
        };
        Ok(SourceConfig {
            url: raw.url,
            password: raw.password,
            password_file: raw.password_file,
            tables: raw.tables,
            tls: raw.tls,
            heartbeat_interval_ms: raw.heartbeat_interval_ms,
            snapshot: raw.snapshot,
            snapshot_where: raw.snapshot_where,
            snapshot_chunk: raw.snapshot_chunk,
            db,
            other_db_keys,
            one_of_several: false,
        })
    }
}

impl std::fmt::Debug for SourceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceConfig")
            .field("url", &redact_url(&self.url))
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("password_file", &self.password_file)
            .field("tables", &self.tables)
            .field("db", &self.db)
            .finish_non_exhaustive()
    }
}

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum TlsMode {
    /// Plain text.
    Disable,
    /// TLS when the server offers it, unverified; plain text otherwise.
    Prefer,
    /// TLS always; the certificate is checked only when `ca` is given (as libpq does).
    Require,
    /// TLS, the certificate's chain checked against `ca` (required); any host name.
    VerifyCa,
    /// TLS, the certificate and the host name verified.
    VerifyFull,
}

#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// How much of TLS to require and verify.
    pub mode: TlsMode,
    /// The CA certificate(s) (PEM) that signed the server's certificate; the system roots when absent.
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// A client certificate (PEM, with any chain after it) for servers that ask for one.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// The client certificate's key (PEM, unencrypted).
    #[serde(default)]
    pub key: Option<PathBuf>,
}

fn default_slot() -> String {
    "outboxd".to_string()
}

fn default_heartbeat_ms() -> u64 {
    5_000
}

fn default_snapshot_chunk() -> usize {
    1_000
}

impl SourceConfig {
    /// One warning per key set for the other kind of database, for `check` and `run`.
    pub fn unused_keys(&self) -> Vec<String> {
        self.other_db_keys
            .iter()
            .map(|key| {
                format!(
                    "{key} does not apply to a {} source and is not used",
                    self.kind().as_str()
                )
            })
            .collect()
    }

    /// Where a run without a checkpoint starts, in words (`check`, `checkpoint show/reset`).
    pub fn first_start(&self) -> &'static str {
        match self.snapshot {
            SnapshotMode::Never => "a run starts at the source's current end",
            SnapshotMode::Initial | SnapshotMode::InitialWhere => "a run first sends the rows already in the outbox tables (source.snapshot), then streams from where that read began",
        }
    }

    pub fn kind(&self) -> SourceKind {
        match self.db {
            SourceDb::Mysql(_) => SourceKind::Mysql,
            SourceDb::Postgres(_) => SourceKind::Postgres,
        }
    }

    /// One URL per host of `url` (see [`source_urls`]).
    pub fn urls(&self) -> Vec<String> {
        source_urls(&self.url)
    }

    /// This config with `url` in place of the configured one (one host of a list).
    pub fn with_url(&self, url: String) -> SourceConfig {
        SourceConfig {
            url,
            one_of_several: self.one_of_several || self.urls().len() > 1,
            ..self.clone()
        }
    }

    /// Reading a standby: this config aimed at `source.primary_url`. A primary URL without
    /// parameters takes those of `source.url` (its TLS settings: `sslmode`, `sslrootcert`, …), so
    /// the primary is reached as safely as the standby.
    pub fn primary(&self) -> Option<SourceConfig> {
        let SourceDb::Postgres(own) = &self.db else {
            return None;
        };
        let primary = own.primary_url.as_ref()?;
        let first = self.urls().into_iter().next().unwrap_or_default();
        let url = match (primary.contains('?'), first.split_once('?')) {
            (false, Some((_, query))) => format!("{primary}?{query}"),
            _ => primary.clone(),
        };
        Some(self.with_url(url))
    }

    /// Checks what serde cannot: URL scheme and hosts, tables, TLS, intervals.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, why: String, fix: &str| {
            Err(Error::config(format!("key `{key}`: {why}")).remedy(fix.to_string()))
        };
        let scheme = self.url.split("://").next().unwrap_or("");
        let expected: &[&str] = match self.kind() {
            SourceKind::Mysql => &["mysql", "mariadb"],
            SourceKind::Postgres => &["postgres", "postgresql"],
        };
        if !self.url.contains("://") || !expected.contains(&scheme) {
            return bad(
                "source.url",
                format!(
                    "{} is not a {} URL",
                    redact_url(&self.url),
                    self.kind().as_str()
                ),
                match self.kind() {
                    SourceKind::Mysql => "use mysql://USER@HOST:PORT/DB",
                    SourceKind::Postgres => "use postgres://USER@HOST:PORT/DB",
                },
            );
        }
        let urls = source_urls(&self.url);
        if urls.iter().any(|u| url::Url::parse(u).is_err()) {
            return bad(
                "source.url",
                format!("{} is not a valid URL", redact_url(&self.url)),
                "percent-encode special characters in the user and password",
            );
        }
        if self.password.is_some() && self.password_file.is_some() {
            return bad(
                "source.password_file",
                "both a password and a password_file are set".into(),
                "keep one of them",
            );
        }
        if self.tables.is_empty() {
            return bad(
                "source.tables",
                "no outbox table listed".into(),
                "list the schema-qualified outbox tables, e.g. tables = [\"app.outbox\"]",
            );
        }
        for t in &self.tables {
            let parts: Vec<&str> = t.split('.').collect();
            if parts.len() != 2 || parts.iter().any(|p| p.is_empty()) {
                return bad(
                    "source.tables",
                    format!("{t:?} is not schema-qualified"),
                    "write each table as \"schema.table\" (MySQL: database.table)",
                );
            }
        }
        match (self.snapshot, &self.snapshot_where) {
            (SnapshotMode::InitialWhere, None) => {
                return bad(
                    "source.snapshot_where",
                    "snapshot = \"initial_where\" needs a predicate".into(),
                    "set snapshot_where to the rows still to send, e.g. snapshot_where = \"published = false\"",
                )
            }
            (SnapshotMode::InitialWhere, Some(w)) if w.trim().is_empty() => {
                return bad(
                    "source.snapshot_where",
                    "the predicate is empty".into(),
                    "write an SQL condition on the outbox columns, e.g. \"published = false\"",
                )
            }
            (SnapshotMode::Never | SnapshotMode::Initial, Some(_)) => {
                return bad(
                    "source.snapshot_where",
                    "a predicate is set, but snapshot is not \"initial_where\"".into(),
                    "set snapshot = \"initial_where\" to use it, or remove snapshot_where",
                )
            }
            _ => {}
        }
        if !(1..=100_000).contains(&self.snapshot_chunk) {
            return bad(
                "source.snapshot_chunk",
                format!("{} rows per read is out of range", self.snapshot_chunk),
                "use 1..=100000 (default 1000)",
            );
        }
        if let SourceDb::Postgres(PostgresOptions {
            primary_url: Some(primary),
            ..
        }) = &self.db
        {
            let one = source_urls(primary);
            if !primary.starts_with("postgres://") && !primary.starts_with("postgresql://")
                || one.len() != 1
                || url::Url::parse(primary).is_err()
            {
                return bad(
                    "source.primary_url",
                    format!("{} is not one Postgres server's URL", redact_url(primary)),
                    "name the primary the standby in source.url follows: postgres://USER@HOST:PORT/DB (one host; percent-encode special characters)",
                );
            }
        }
        // URL TLS parameters against source.tls (files are read when connecting).
        crate::source::tls::TlsSettings::of(self)?;
        if let Some(primary) = self.primary() {
            crate::source::tls::TlsSettings::of(&primary).map_err(|e| {
                Error::config(format!("source.primary_url: {}", e.message())).remedy(
                    e.remedy_text()
                        .unwrap_or("fix its TLS parameters")
                        .to_string(),
                )
            })?;
        }
        if self.heartbeat_interval_ms < 100 {
            return bad(
                "source.heartbeat_interval_ms",
                format!("{} ms is too short", self.heartbeat_interval_ms),
                "use at least 100 (default 5000)",
            );
        }
        Ok(())
    }

    /// The source password, from the URL, `source.password` or `source.password_file`.
    pub fn password(&self) -> Result<Option<String>> {
        if let Some(p) = &self.password {
            return Ok(Some(p.clone()));
        }
        if let Some(path) = &self.password_file {
            let text = std::fs::read_to_string(path).map_err(|e| {
                Error::config(format!(
                    "cannot read source.password_file {}: {e}",
                    path.display()
                ))
                .remedy("check the path and that outboxd may read it")
            })?;
            return Ok(Some(text.trim_end_matches(['\n', '\r']).to_string()));
        }
        Ok(None)
    }
}

/// The secrets a `source.url` (one host or several) carries: its password, as written and decoded,
/// and the values of secret-looking query parameters.
pub(crate) fn url_secrets(raw: &str) -> Vec<String> {
    let mut secrets = Vec::new();
    for one in source_urls(raw) {
        let Ok(url) = url::Url::parse(&one) else {
            continue;
        };
        if let Some(p) = url.password() {
            secrets.push(p.to_string());
            if let Ok(decoded) = percent_encoding::percent_decode_str(p).decode_utf8() {
                secrets.push(decoded.into_owned());
            }
        }
        for (key, value) in url.query_pairs() {
            if is_secret_key(&key) {
                secrets.push(value.into_owned());
            }
        }
    }
    secrets
}

/// One URL per host of `source.url`: `mysql://cdc@r1:3306,r2:3306/app` lists two servers of one
/// replication topology (tried in order; outboxd moves on when one fails and resumes by GTID).
pub fn source_urls(raw: &str) -> Vec<String> {
    let Some((scheme, rest)) = raw.split_once("://") else {
        return vec![raw.to_string()];
    };
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((u, r)) if !r.contains('@') => (Some(u), r),
        _ => (None, rest),
    };
    let split = rest.find(['/', '?']).unwrap_or(rest.len());
    let (hosts, tail) = rest.split_at(split);
    hosts
        .split(',')
        .map(|host| match userinfo {
            Some(u) => format!("{scheme}://{u}@{host}{tail}"),
            None => format!("{scheme}://{host}{tail}"),
        })
        .collect()
}

/// `scheme://user:secret@host/db` -> `scheme://user:***@host/db` (each host of a list); anything
/// unparsable is hidden whole.
pub fn redact_url(raw: &str) -> String {
    let urls = source_urls(raw);
    let mut hosts = Vec::with_capacity(urls.len());
    let mut first = None;
    for one in &urls {
        match url::Url::parse(one) {
            Ok(mut u) => {
                if u.password().is_some() {
                    let _ = u.set_password(Some("***"));
                }
                if u.query_pairs().any(|(k, _)| is_secret_key(&k)) {
                    let pairs: Vec<(String, String)> = u
                        .query_pairs()
                        .map(|(k, v)| {
                            let v = if is_secret_key(&k) {
                                "***".into()
                            } else {
                                v.into_owned()
                            };
                            (k.into_owned(), v)
                        })
                        .collect();
                    u.query_pairs_mut().clear().extend_pairs(pairs);
                }
                hosts.push(match u.port() {
                    Some(p) => format!("{}:{p}", u.host_str().unwrap_or("")),
                    None => u.host_str().unwrap_or("").to_string(),
                });
                first.get_or_insert(u);
            }
            Err(_) => return "<unparsable url>".to_string(),
        }
    }
    match first {
        Some(u) if urls.len() > 1 => {
            let shown = u.to_string();
            let host = match u.port() {
                Some(p) => format!("{}:{p}", u.host_str().unwrap_or("")),
                None => u.host_str().unwrap_or("").to_string(),
            };
            shown.replacen(&host, &hosts.join(","), 1)
        }
        Some(u) => u.to_string(),
        None => "<unparsable url>".to_string(),
    }
}
