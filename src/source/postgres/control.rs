//! The control plane: an ordinary SQL connection (tokio-postgres) for the slot, the publication, the
//! heartbeat message and preflight queries. The replication stream itself is a separate connection.

use std::time::Duration;

use tokio_postgres::config::SslMode;
use tokio_postgres::{Client, NoTls};

use super::lsn::parse_lsn;
use super::socket::{self, Protection};
use crate::error::{Error, Result};
use crate::source::config::{redact_url, SourceConfig, SourceKind};
use crate::source::tls::{
    alert_error, connection_lost, url_tls_keys, ClientTls, TlsSettings, NEEDS_TLS_REMEDY,
};

/// Where and as whom to connect, from `source.url` and the password settings.
#[derive(Clone)]
pub struct ConnInfo {
    pub host: String,
    pub port: u16,
    pub user: String,
    pub password: Option<String>,
    pub dbname: String,
    /// `source.url` with the password hidden, for messages.
    pub shown: String,
    /// The replication connection's `application_name` (the control connection adds `-control`).
    pub application_name: String,
    /// TLS for both connections (None: plain text).
    pub tls: Option<ClientTls>,
}

impl ConnInfo {
    /// The first host of `source.url` (a session of the pipeline gets a config naming the host it
    /// reads).
    pub fn from_config(config: &SourceConfig) -> Result<ConnInfo> {
        let first = config.urls().into_iter().next().unwrap_or_default();
        let url = url::Url::parse(&first)
            .map_err(|e| Error::config(format!("source.url {}: {e}", redact_url(&config.url))))?;
        let bad = |what: &str| {
            Error::config(format!(
                "source.url {} has no {what}",
                redact_url(&config.url)
            ))
            .remedy("use postgres://USER@HOST:PORT/DATABASE")
        };
        let host = url.host_str().ok_or_else(|| bad("host"))?.to_string();
        let user = url.username();
        if user.is_empty() {
            return Err(bad("user"));
        }
        let dbname = url.path().trim_start_matches('/');
        if dbname.is_empty() {
            return Err(bad("database"));
        }
        let decode = |s: &str| {
            url::form_urlencoded::parse(format!("x={s}").as_bytes())
                .next()
                .map(|(_, v)| v.into_owned())
                .unwrap_or_default()
        };
        let password = match config.password()? {
            Some(p) => Some(p),
            None => url.password().map(decode),
        };
        let mut application_name = None;
        for (key, value) in url.query_pairs() {
            match key.as_ref() {
                "application_name" => application_name = Some(value.into_owned()),
                // Read by TlsSettings::of.
                key if url_tls_keys(SourceKind::Postgres).contains(&key) => {}
                "password" => {
                    return Err(Error::config(
                        "source.url carries the password as a query parameter",
                    )
                    .remedy("move it to source.password or source.password_file (or OUTBOXD_SOURCE__PASSWORD)"))
                }
                other => {
                    return Err(Error::config(format!(
                        "source.url parameter {other:?} is not supported"
                    ))
                    .remedy("remove it; outboxd honours application_name, sslmode, sslrootcert, sslcert and sslkey in a Postgres URL (or set TLS in source.tls)"))
                }
            }
        }
        Ok(ConnInfo {
            host,
            port: url.port().unwrap_or(5432),
            user: decode(user),
            password,
            dbname: decode(dbname),
            shown: redact_url(&first),
            application_name: application_name.unwrap_or_else(|| "outboxd".to_string()),
            tls: TlsSettings::of(config)?.load()?,
        })
    }
}

/// What the catalog says about one configured table and a publication.
#[derive(Debug, Default, Clone, Copy)]
pub struct PublicationState {
    pub exists: bool,
    pub partitioned: bool,
    pub published: bool,
}

/// `schema.table` (unqualified: `public`).
pub fn split_table(table: &str) -> (&str, &str) {
    table.split_once('.').unwrap_or(("public", table))
}

/// The statement outboxd runs when the publication is missing.
pub fn create_publication_sql(name: &str, tables: &[String]) -> String {
    let list: Vec<String> = tables.iter().map(|t| quote_table(t)).collect();
    format!(
        "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert', publish_via_partition_root = true)",
        quote_ident(name),
        list.join(", ")
    )
}

/// The fix for a publication that sends a partitioned outbox's rows under its partitions' names.
pub fn via_root_sql(name: &str) -> String {
    format!(
        "ALTER PUBLICATION {} SET (publish_via_partition_root = true);",
        quote_ident(name)
    )
}

pub struct Control {
    client: Client,
    shown: String,
    /// Whether this connection is encrypted (outboxd's side of it, not the server's view).
    pub protection: Protection,
}

/// SQLSTATEs a reconnect can cure: connection exceptions (08), insufficient resources such as too
/// many connections (53), operator intervention such as shutdown or recovery (57), serialization and
/// deadlock failures (40), and a slot still held by a previous connection (55006).
pub fn transient_sqlstate(code: &str) -> bool {
    matches!(code.get(..2), Some("08" | "53" | "57" | "40")) || code == "55006"
}

/// The server's own message and SQLSTATE when there is one (tokio-postgres prints just "db error").
fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => {
            // tokio-postgres prints only its own layer ("error communicating with the server").
            let mut text = e.to_string();
            let mut cause = std::error::Error::source(e);
            while let Some(c) = cause {
                // io::Error passes its inner error's source on: skip a repeat.
                let part = c.to_string();
                if !text.contains(&part) {
                    text.push_str(": ");
                    text.push_str(&part);
                }
                cause = c.source();
            }
            text
        }
    }
}

pub(super) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `schema.table` -> `"schema"."table"`.
pub fn quote_table(table: &str) -> String {
    match table.split_once('.') {
        Some((schema, name)) => format!("{}.{}", quote_ident(schema), quote_ident(name)),
        None => quote_ident(table),
    }
}

/// A refused login, with the TLS hint where the server turned plain text away.
pub fn login_error(info: &ConnInfo, protection: Protection, e: &tokio_postgres::Error) -> Error {
    let error = Error::source(format!("cannot connect to {}: {}", info.shown, describe(e)));
    match e.code() {
        Some(code) if transient_sqlstate(code.code()) => error
            .remedy("outboxd retries; the server is starting, shutting down or short of connections")
            .transient(),
        Some(_) if refuses_plain_text(&describe(e)) && protection == Protection::Plain => {
            error.remedy(NEEDS_TLS_REMEDY)
        }
        Some(_) if describe(e).contains("certificate") => error.remedy(
            "the server wants a client certificate it accepts: set source.tls.cert and source.tls.key (its CN must be the user name under clientcert=verify-full)",
        ),
        Some(_) => error.remedy("check the user, password and database in source.url, and pg_hba.conf"),
        // TLS 1.3 reports a refused client certificate on the first read, after the handshake.
        None => alert_error(&info.shown, &describe(e)).unwrap_or_else(|| {
            error
                .remedy("outboxd retries; check that the server is up")
                .transient()
        }),
    }
}

/// pg_hba.conf rejected a connection for being unencrypted.
pub fn refuses_plain_text(message: &str) -> bool {
    message.contains("no encryption")
}

/// What became of the connection holding a replication slot (`Control::end_slot_holder`).
#[derive(Debug, PartialEq)]
pub enum SlotHolder {
    /// Nobody held it.
    Free,
    /// Held by a connection that is not this pipeline's (another role or `application_name`).
    NotOurs { pid: i32, name: Option<String> },
    /// Ended, and the slot is free.
    Ended { pid: i32 },
    /// The process was gone by the time it was signalled.
    Gone { pid: i32 },
    /// Signalled, but it still held the slot when the wait ended.
    StillHeld { pid: i32 },
}

/// The oldest server outboxd reads, as `server_version_num`.
pub const MIN_SERVER: i32 = 140_000;
/// Logical decoding on a standby came in 16.
pub const STANDBY_DECODING: i32 = 160_000;
/// Failover slots (`failover`, `synced`, `sync_replication_slots`) came in 17.
pub const FAILOVER_SLOTS: i32 = 170_000;

/// The server's version and whether it is a standby (in recovery).
#[derive(Debug, Clone)]
pub struct Server {
    /// `server_version_num`, e.g. 170011.
    pub number: i32,
    /// `server_version`, e.g. "17.11".
    pub version: String,
    pub standby: bool,
}

impl Server {
    /// Whether a slot made here is made a failover slot: on a 17+ primary, so that standbys with
    /// `sync_replication_slots` keep a copy a promotion can continue from. Harmless without
    /// standbys; a standby cannot make one.
    pub fn failover_slots(&self) -> bool {
        self.number >= FAILOVER_SLOTS && !self.standby
    }

    /// The major version, e.g. 17.
    pub fn major(&self) -> i32 {
        self.number / 10_000
    }
}

/// A logical slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone)]
pub struct SlotState {
    pub confirmed: u64,
    pub temporary: bool,
    /// 17+: the primary's slot is copied to standbys that synchronize slots.
    pub failover: bool,
    /// 17+: this is such a copy (on a standby; left over on a promoted one).
    pub synced: bool,
    /// Why Postgres invalidated the slot (`wal_status = lost`, 17+'s `invalidation_reason`, 16's
    /// `conflicting`), if it did: it can no longer be decoded from.
    pub invalidated: Option<String>,
}

impl Control {
    pub async fn connect(info: &ConnInfo) -> Result<Control> {
        let mut config = tokio_postgres::Config::new();
        config
            .host(&info.host)
            .port(info.port)
            .user(&info.user)
            .dbname(&info.dbname)
            .application_name(format!("{}-control", info.application_name))
            // TLS, if any, is already on the socket (socket.rs).
            .ssl_mode(SslMode::Disable);
        if let Some(p) = &info.password {
            config.password(p);
        }
        let (socket, protection) = socket::connect(info).await?;
        let login =
            tokio::time::timeout(Duration::from_secs(10), config.connect_raw(socket, NoTls));
        let (client, connection) = match login.await {
            Ok(Ok(connected)) => connected,
            Ok(Err(e)) => {
                if connection_lost(&e) {
                    if let Some(refused) = socket::client_cert_refused(info).await {
                        return Err(refused.caused_by(e));
                    }
                }
                return Err(login_error(info, protection, &e).caused_by(e));
            }
            Err(_) => {
                return Err(Error::source(format!(
                    "{}: the login did not finish within 10 s",
                    info.shown
                ))
                .remedy("outboxd retries; check that the server is up")
                .transient())
            }
        };
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Control {
            client,
            shown: info.shown.clone(),
            protection,
        })
    }

    /// A connection to the first host of `source.url` that answers and is a primary, or, when none
    /// is, to the first standby that answers (one-shot lookups such as the current WAL end; a
    /// session, of `run` or `snapshot`, is given its host by the pipeline). With one host, that
    /// host. When no host answers, the first host's error.
    pub async fn connect_primary(config: &SourceConfig) -> Result<(ConnInfo, Control)> {
        let urls = config.urls();
        if urls.len() < 2 {
            let info = ConnInfo::from_config(config)?;
            let control = Control::connect(&info).await?;
            return Ok((info, control));
        }
        let mut standby = None;
        let mut failed = None;
        for url in urls {
            let info = ConnInfo::from_config(&config.with_url(url))?;
            let asked = async {
                let control = Control::connect(&info).await?;
                let server = control.server().await?;
                Ok::<_, Error>((control, server))
            };
            match tokio::time::timeout(Duration::from_secs(20), asked).await {
                Ok(Ok((control, server))) if !server.standby => return Ok((info, control)),
                Ok(Ok((control, _))) => {
                    standby.get_or_insert((info, control));
                }
                Ok(Err(e)) => {
                    failed.get_or_insert(e);
                }
                Err(_) => {
                    failed.get_or_insert(
                        Error::source(format!("{}: no answer within 20 s", info.shown)).transient(),
                    );
                }
            }
        }
        match (standby, failed) {
            (Some(found), _) => Ok(found),
            (None, Some(e)) => Err(e),
            (None, None) => Err(Error::config("source.url lists no host")),
        }
    }

    /// The server's version and role, refusing one older than [`MIN_SERVER`]: `pgoutput` takes the
    /// `messages` option (the heartbeat and the table-less outbox ride on logical decoding
    /// messages) from 14 on, and 13 would answer the replication command with "unrecognized
    /// pgoutput option".
    pub async fn server(&self) -> Result<Server> {
        let row = self
            .client
            .query_one(
                "SELECT current_setting('server_version_num')::int, current_setting('server_version'), pg_is_in_recovery()",
                &[],
            )
            .await
            .map_err(|e| self.failed("reading the server's version", e))?;
        let server = Server {
            number: row.get(0),
            version: row.get(1),
            standby: row.get(2),
        };
        if server.number < MIN_SERVER {
            return Err(Error::source(format!(
                "{}: PostgreSQL {} is too old: outboxd reads PostgreSQL 14 and later (pgoutput's logical decoding messages, which carry its heartbeat and the table-less outbox, came in 14)",
                self.shown, server.version
            ))
            .remedy("point source.url at PostgreSQL 14 or later (upgrade the server, or read a newer replica)"));
        }
        Ok(server)
    }

    /// The TLS protocol version and cipher of this connection (`pg_stat_ssl`), None in plain text.
    pub async fn tls_in_use(&self) -> Result<Option<(String, String)>> {
        let row = self
            .client
            .query_opt(
                "SELECT version, cipher FROM pg_stat_ssl WHERE pid = pg_backend_pid() AND ssl",
                &[],
            )
            .await
            .map_err(|e| self.failed("reading pg_stat_ssl", e))?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

    pub(super) fn failed(&self, what: &str, e: tokio_postgres::Error) -> Error {
        let error = Error::source(format!("{} ({what}): {}", self.shown, describe(&e)));
        let error = match e.code() {
            Some(code) if !transient_sqlstate(code.code()) => error,
            _ => error.transient(),
        };
        error.caused_by(e)
    }

    /// Creates the publication (`FOR TABLE … WITH (publish = 'insert', publish_via_partition_root =
    /// true)`) if missing; otherwise checks that it publishes inserts of every configured table.
    ///
    /// A partitioned outbox needs `publish_via_partition_root`: with it every row, of partitions
    /// added later too, arrives under the outbox's own name (decoded with the catalog of its time);
    /// without it rows arrive under the partitions' names, so it is refused with the `ALTER` to run.
    pub async fn ensure_publication(&self, name: &str, tables: &[String]) -> Result<()> {
        let row = self
            .client
            .query_opt(
                "SELECT pubinsert, puballtables, pubviaroot FROM pg_publication WHERE pubname = $1",
                &[&name],
            )
            .await
            .map_err(|e| self.failed("reading pg_publication", e))?;
        let Some(row) = row else {
            let sql = create_publication_sql(name, tables);
            self.client.batch_execute(&sql).await.map_err(|e| {
                self.failed("creating the publication", e).remedy(format!(
                    "run as the tables' owner (it needs CREATE on the database): {sql}; outboxd only needs it to exist"
                ))
            })?;
            tracing::info!(publication = name, "created the publication");
            return Ok(());
        };
        let (insert, all, via_root): (bool, bool, bool) = (row.get(0), row.get(1), row.get(2));
        if !insert {
            return Err(
                Error::source(format!("publication {name} does not publish INSERTs")).remedy(
                    format!(
                        "ALTER PUBLICATION {} SET (publish = 'insert')",
                        quote_ident(name)
                    ),
                ),
            );
        }
        let mut missing = Vec::new();
        for table in tables {
            let state = self
                .publication_state(name, table)
                .await
                .map_err(|e| self.failed("reading pg_publication_tables", e))?;
            // Without the option the rows arrive under the partitions' names, and a partition
            // detached before outboxd reads its rows could no longer be told from any other table.
            if state.partitioned && !via_root {
                return Err(Error::source(format!(
                    "{table} is partitioned, and publication {name} sends its rows under the partitions' names (publish_via_partition_root is off)"
                ))
                .remedy(via_root_sql(name)));
            }
            if !all && !state.published {
                missing.push(quote_table(table));
            }
        }
        if !missing.is_empty() {
            return Err(Error::source(format!(
                "publication {name} does not include {}",
                missing.join(", ")
            ))
            .remedy(format!(
                "ALTER PUBLICATION {} ADD TABLE {}",
                quote_ident(name),
                missing.join(", ")
            )));
        }
        Ok(())
    }

    /// [`Control::ensure_publication`] on `server`: a standby cannot create the publication, and
    /// that is this host's refusal (another listed host, the primary, can).
    pub async fn ensure_publication_on(
        &self,
        server: &Server,
        name: &str,
        tables: &[String],
    ) -> Result<()> {
        self.ensure_publication(name, tables).await.map_err(|e| {
            if server.standby {
                e.refused_by_host()
            } else {
                e
            }
        })
    }

    /// Whether `table` exists, is partitioned, and is published by `publication` under its own name
    /// (for a partitioned table that needs `publish_via_partition_root`; without it the publication
    /// lists the partitions instead, which outboxd refuses anyway).
    pub async fn publication_state(
        &self,
        publication: &str,
        table: &str,
    ) -> std::result::Result<PublicationState, tokio_postgres::Error> {
        let (schema, name) = split_table(table);
        let row = self
            .client
            .query_opt(
                "SELECT c.relkind = 'p', EXISTS ( \
                   SELECT 1 FROM pg_publication_tables pt \
                   WHERE pt.pubname = $3 AND pt.schemaname = n.nspname AND pt.tablename = c.relname) \
                 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relname = $2",
                &[&schema, &name, &publication],
            )
            .await?;
        Ok(match row {
            Some(row) => PublicationState {
                exists: true,
                partitioned: row.get(0),
                published: row.get(1),
            },
            None => PublicationState::default(),
        })
    }

    /// The relation `relid` and its partition ancestors up to the root, as `schema.table` names
    /// (empty for a table that is no partition), or `None` when no such relation exists (any more).
    /// One statement, so one catalog snapshot answers both questions.
    pub async fn partition_ancestors(&self, relid: u32) -> Result<Option<Vec<String>>> {
        let row = self
            .client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_class WHERE oid = $1::oid), \
                   ARRAY(SELECT n.nspname || '.' || c.relname \
                     FROM pg_partition_ancestors($1::oid::regclass) WITH ORDINALITY a(relid, depth) \
                     JOIN pg_class c ON c.oid = a.relid JOIN pg_namespace n ON n.oid = c.relnamespace \
                     ORDER BY a.depth)",
                &[&relid],
            )
            .await
            .map_err(|e| self.failed("reading the relation's partition ancestors", e))?;
        let exists: bool = row.get(0);
        Ok(exists.then(|| row.get(1)))
    }

    /// The relation OIDs of every partition (at any level) of the configured partitioned `tables`,
    /// with the configured table each belongs to. Taken at session start: a partition detached
    /// later keeps its OID, so rows decoded from before its detachment are still recognised.
    pub async fn outbox_partitions(
        &self,
        tables: &[String],
    ) -> Result<std::collections::HashMap<u32, String>> {
        let mut partitions = std::collections::HashMap::new();
        for table in tables {
            let (schema, name) = split_table(table);
            let rows = self
                .client
                .query(
                    "SELECT p.relid::oid FROM pg_class c \
                     JOIN pg_namespace n ON n.oid = c.relnamespace, \
                     LATERAL pg_partition_tree(c.oid) p \
                     WHERE n.nspname = $1 AND c.relname = $2 AND p.relid::oid <> c.oid",
                    &[&schema, &name],
                )
                .await
                .map_err(|e| self.failed("reading the outbox's partitions", e))?;
            for row in rows {
                partitions.insert(row.get::<_, u32>(0), table.clone());
            }
        }
        Ok(partitions)
    }

    /// Creates the slot (pgoutput) and returns its `confirmed_flush_lsn`. On a 17+ primary it is a
    /// failover slot ([`Server::failover_slots`]).
    pub async fn create_slot(&self, slot: &str, server: &Server) -> Result<u64> {
        let failover = server.failover_slots();
        let sql = if failover {
            "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
        } else {
            "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')"
        };
        if server.standby {
            tracing::info!(
                slot,
                "creating the replication slot on a standby: it waits for the primary's next record of running transactions (written every 15 s while the primary is busy; `SELECT pg_log_standby_snapshot()` on the primary writes one now)"
            );
        }
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&slot];
        let created = self.client.query_one(sql, &params);
        let row = match tokio::time::timeout(Duration::from_secs(120), created).await {
            Ok(row) => row.map_err(|e| {
                self.failed("creating the replication slot", e).remedy(
                    "the user needs the REPLICATION attribute (ALTER ROLE … REPLICATION) and a free slot (max_replication_slots)",
                )
            })?,
            // Dropping the query leaves the server waiting; the next session's connection asks anew.
            Err(_) => {
                return Err(Error::source(format!(
                    "{}: creating the replication slot did not finish within 120 s (on a standby it waits for the primary's next record of running transactions)",
                    self.shown
                ))
                .remedy("run SELECT pg_log_standby_snapshot() on the primary; outboxd tries again")
                .transient())
            }
        };
        let text: String = row.get(0);
        tracing::info!(slot, lsn = %text, failover, "created the replication slot");
        parse_lsn(&text).ok_or_else(|| Error::source(format!("slot LSN {text:?} is not an LSN")))
    }

    /// The slot's `confirmed_flush_lsn`; `None` if there is no such slot. A slot of another plugin is
    /// an error.
    pub async fn slot_confirmed(&self, slot: &str) -> Result<Option<u64>> {
        Ok(self.slot(slot).await?.map(|s| s.confirmed))
    }

    /// What `pg_replication_slots` says about `slot` in this database; `None` if there is no such
    /// slot. A slot of another plugin is an error.
    pub async fn slot(&self, slot: &str) -> Result<Option<SlotState>> {
        // `failover` and `synced` came in 17.
        // Slot names are the cluster's, not a database's.
        let row = self
            .client
            .query_opt(
                "SELECT to_jsonb(s)::text, s.database = current_database() FROM pg_replication_slots s \
                 WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(|e| self.failed("reading pg_replication_slots", e))?;
        let Some(row) = row else { return Ok(None) };
        let state: serde_json::Value = serde_json::from_str(row.get(0))
            .map_err(|e| Error::source(format!("reading pg_replication_slots: {e}")))?;
        let text = |key: &str| state.get(key).and_then(|v| v.as_str()).map(str::to_string);
        let flag = |key: &str| state.get(key).and_then(|v| v.as_bool()).unwrap_or(false);
        if row.get::<_, Option<bool>>(1) != Some(true) {
            return Err(Error::source(format!(
                "replication slot {slot} belongs to database {} (or is a physical slot), not this one",
                text("database").unwrap_or_else(|| "none".into())
            ))
            .remedy("set source.slot to another name (outboxd creates it), or point source.url at that database")
            .refused_by_host());
        }
        let plugin = text("plugin");
        if plugin.as_deref() != Some("pgoutput") {
            return Err(Error::source(format!(
                "replication slot {slot} uses plugin {}, not pgoutput",
                plugin.unwrap_or_default()
            ))
            .remedy("set source.slot to another name (outboxd creates it), or drop that slot"));
        }
        Ok(Some(SlotState {
            confirmed: text("confirmed_flush_lsn")
                .as_deref()
                .and_then(parse_lsn)
                .unwrap_or(0),
            temporary: flag("temporary"),
            failover: flag("failover"),
            synced: flag("synced"),
            invalidated: text("invalidation_reason")
                .or_else(|| {
                    (text("wal_status").as_deref() == Some("lost"))
                        .then(|| "wal_status = lost".into())
                })
                .or_else(|| flag("conflicting").then(|| "conflicting with recovery".into())),
        }))
    }

    /// Ends the connection that holds `slot` if it is one of this pipeline's (the same role and the
    /// same `application_name` as `ours`), and waits (at most `limit`) until the slot is free. Only
    /// called when the lead fenced every earlier instance (see `PostgresSource::connect`); a holder
    /// that is not outboxd's (another tool, another role, an operator's session) is left alone.
    pub async fn end_slot_holder(
        &self,
        slot: &str,
        ours: &str,
        limit: Duration,
    ) -> Result<SlotHolder> {
        let Some((pid, user, name)) = self
            .slot_holder(slot)
            .await
            .map_err(|e| self.failed("reading pg_replication_slots", e))?
        else {
            return Ok(SlotHolder::Free);
        };
        if !user || name.as_deref() != Some(ours) {
            return Ok(SlotHolder::NotOurs { pid, name });
        }
        let signalled: bool = self
            .client
            .query_one("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .map_err(|e| {
                self.failed("ending the connection that holds the replication slot", e)
                    .remedy(format!(
                        "the slot {slot} is held by process {pid}, which outboxd's user may not end (another role's, or a superuser's): end it yourself, or wait for wal_sender_timeout to end it"
                    ))
            })?
            .get(0);
        if !signalled {
            return Ok(SlotHolder::Gone { pid });
        }
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            match self.slot_holder(slot).await {
                Ok(Some((p, ..))) if p == pid => {}
                Ok(_) => return Ok(SlotHolder::Ended { pid }),
                Err(e) => return Err(self.failed("reading pg_replication_slots", e)),
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(SlotHolder::StillHeld { pid });
            }
            // Postgres says nothing when a backend exits: look again shortly.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The connection holding `slot`, if any: its process id, whether it runs as this connection's
    /// role, and its `application_name`.
    async fn slot_holder(
        &self,
        slot: &str,
    ) -> std::result::Result<Option<(i32, bool, Option<String>)>, tokio_postgres::Error> {
        self.client
            .query_opt(
                "SELECT s.active_pid, a.usename = current_user, a.application_name \
                 FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid \
                 WHERE s.slot_name = $1 AND s.database = current_database() AND s.active_pid IS NOT NULL",
                &[&slot],
            )
            .await
            .map(|row| {
                row.map(|r| {
                    (
                        r.get::<_, i32>(0),
                        r.get::<_, Option<bool>>(1).unwrap_or(false),
                        r.get::<_, Option<String>>(2),
                    )
                })
            })
    }

    /// Whether the connection is gone (the server closed it, or the network failed).
    pub fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    /// The cluster's system identifier (the same on its physical standbys), as IDENTIFY_SYSTEM
    /// gives it.
    pub async fn system_identifier(&self) -> Result<String> {
        let row = self
            .client
            .query_one("SELECT system_identifier FROM pg_control_system()", &[])
            .await
            .map_err(|e| self.failed("reading the system identifier", e))?;
        // A bigint here, unsigned in IDENTIFY_SYSTEM: the same 64 bits either way.
        Ok((row.get::<_, i64>(0) as u64).to_string())
    }

    /// A non-transactional message that makes the walsender send us something even when the database
    /// is idle. Fails on a standby (read-only).
    pub async fn emit_heartbeat(&self) -> Result<()> {
        self.client
            .batch_execute(&format!(
                "SELECT pg_logical_emit_message(false, '{}', '')",
                super::decoder::HEARTBEAT_PREFIX
            ))
            .await
            .map_err(|e| self.failed("emitting the heartbeat message", e))
    }

    /// How far the walsender streaming `slot` has read WAL (`pg_stat_replication.sent_lsn`): `None`
    /// when no walsender holds the slot, `Some(None)` when the server hides it (the user lacks
    /// `pg_read_all_stats`).
    pub async fn walsender_sent_lsn(&self, slot: &str) -> Result<Option<Option<u64>>> {
        let row = self
            .client
            .query_opt(
                "SELECT r.sent_lsn::text FROM pg_replication_slots s \
                 JOIN pg_stat_replication r ON r.pid = s.active_pid \
                 WHERE s.slot_name = $1 AND s.database = current_database()",
                &[&slot],
            )
            .await
            .map_err(|e| self.failed("reading pg_stat_replication", e))?;
        Ok(row.map(|r| {
            r.get::<_, Option<String>>(0)
                .and_then(|text| parse_lsn(&text))
        }))
    }

    /// The server's `wal_sender_timeout` (`None` when it is 0, i.e. off).
    pub async fn wal_sender_timeout(&self) -> Result<Option<Duration>> {
        let row = self
            .client
            .query_one(
                "SELECT setting::bigint FROM pg_settings WHERE name = 'wal_sender_timeout'",
                &[],
            )
            .await
            .map_err(|e| self.failed("reading wal_sender_timeout", e))?;
        let ms: i64 = row.get(0);
        Ok((ms > 0).then(|| Duration::from_millis(ms as u64)))
    }

    /// The server's current WAL insert position (primary) or replay position (standby): every
    /// transaction visible now committed before it. The insert position, not the write position
    /// `pg_current_wal_lsn()`: a commit with `synchronous_commit = off` is visible before its WAL
    /// is written.
    pub async fn current_lsn(&self) -> Result<u64> {
        let row = self
            .client
            .query_one(
                "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_insert_lsn() END)::text",
                &[],
            )
            .await
            .map_err(|e| self.failed("reading the current WAL position", e))?;
        let text: String = row.get(0);
        parse_lsn(&text).ok_or_else(|| Error::source(format!("{text:?} is not an LSN")))
    }

    pub fn client(&self) -> &Client {
        &self.client
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn restarts_and_overload_are_transient_but_auth_is_not() {
        for code in ["57P03", "57P01", "53300", "08006", "40001", "55006"] {
            assert!(super::transient_sqlstate(code), "{code}");
        }
        for code in ["28P01", "3D000", "42501", "42704"] {
            assert!(!super::transient_sqlstate(code), "{code}");
        }
    }
}
