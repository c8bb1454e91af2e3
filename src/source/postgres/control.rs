//! The control plane: an ordinary SQL connection (tokio-postgres) for the slot, the publication, the
//! heartbeat message and preflight queries. The replication stream itself is a separate connection.

use std::time::Duration;

use tokio_postgres::{Client, NoTls};

use super::pgoutput::parse_lsn;
use crate::config::{redact_url, Config};
use crate::error::{Error, Result};

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
}

impl ConnInfo {
    pub fn from_config(config: &Config) -> Result<ConnInfo> {
        let url = url::Url::parse(&config.source.url).map_err(|e| {
            Error::config(format!(
                "source.url {}: {e}",
                redact_url(&config.source.url)
            ))
        })?;
        let bad = |what: &str| {
            Error::config(format!(
                "source.url {} has no {what}",
                redact_url(&config.source.url)
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
        let password = match config.source_password()? {
            Some(p) => Some(p),
            None => url.password().map(decode),
        };
        Ok(ConnInfo {
            host,
            port: url.port().unwrap_or(5432),
            user: decode(user),
            password,
            dbname: decode(dbname),
            shown: redact_url(&config.source.url),
        })
    }
}

pub struct Control {
    client: Client,
    shown: String,
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
        None => e.to_string(),
    }
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `schema.table` -> `"schema"."table"`.
pub fn quote_table(table: &str) -> String {
    match table.split_once('.') {
        Some((schema, name)) => format!("{}.{}", quote_ident(schema), quote_ident(name)),
        None => quote_ident(table),
    }
}

impl Control {
    pub async fn connect(info: &ConnInfo) -> Result<Control> {
        let mut config = tokio_postgres::Config::new();
        config
            .host(&info.host)
            .port(info.port)
            .user(&info.user)
            .dbname(&info.dbname)
            .application_name("outboxd-control")
            .connect_timeout(Duration::from_secs(10));
        if let Some(p) = &info.password {
            config.password(p);
        }
        let (client, connection) = config.connect(NoTls).await.map_err(|e| {
            let error = Error::source(format!(
                "cannot connect to {}: {}",
                info.shown,
                describe(&e)
            ));
            if e.code().is_some() {
                error.remedy("check the user, password and database in source.url, and pg_hba.conf")
            } else {
                error
                    .remedy("outboxd retries; check that the server is up")
                    .transient()
            }
        })?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Control {
            client,
            shown: info.shown.clone(),
        })
    }

    fn failed(&self, what: &str, e: tokio_postgres::Error) -> Error {
        let error = Error::source(format!("{} ({what}): {}", self.shown, describe(&e)));
        match e.code() {
            Some(code) if !transient_sqlstate(code.code()) => error,
            _ => error.transient(),
        }
    }

    /// Creates the publication (`FOR TABLE … WITH (publish = 'insert')`) if missing; otherwise checks
    /// that it publishes inserts of every configured table.
    pub async fn ensure_publication(&self, name: &str, tables: &[String]) -> Result<()> {
        let row = self
            .client
            .query_opt(
                "SELECT pubinsert, puballtables FROM pg_publication WHERE pubname = $1",
                &[&name],
            )
            .await
            .map_err(|e| self.failed("reading pg_publication", e))?;
        let Some(row) = row else {
            let list: Vec<String> = tables.iter().map(|t| quote_table(t)).collect();
            let sql = format!(
                "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert')",
                quote_ident(name),
                list.join(", ")
            );
            self.client.batch_execute(&sql).await.map_err(|e| {
                self.failed("creating the publication", e).remedy(format!(
                    "run as the tables' owner (it needs CREATE on the database): {sql}; outboxd only needs it to exist"
                ))
            })?;
            tracing::info!(publication = name, "created the publication");
            return Ok(());
        };
        let (insert, all): (bool, bool) = (row.get(0), row.get(1));
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
        if all {
            return Ok(());
        }
        let published: Vec<String> = self
            .client
            .query(
                "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1",
                &[&name],
            )
            .await
            .map_err(|e| self.failed("reading pg_publication_tables", e))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let missing: Vec<&String> = tables.iter().filter(|t| !published.contains(t)).collect();
        if !missing.is_empty() {
            let list: Vec<String> = missing.iter().map(|t| quote_table(t)).collect();
            return Err(Error::source(format!(
                "publication {name} does not include {}",
                list.join(", ")
            ))
            .remedy(format!(
                "ALTER PUBLICATION {} ADD TABLE {}",
                quote_ident(name),
                list.join(", ")
            )));
        }
        Ok(())
    }

    /// The slot's `confirmed_flush_lsn`, creating the slot (pgoutput) if missing.
    pub async fn ensure_slot(&self, slot: &str) -> Result<u64> {
        if let Some(lsn) = self.slot_confirmed(slot).await? {
            return Ok(lsn);
        }
        let row = self
            .client
            .query_one(
                "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&slot],
            )
            .await
            .map_err(|e| {
                self.failed("creating the replication slot", e).remedy(
                    "the user needs the REPLICATION attribute (ALTER ROLE … REPLICATION) and a free slot (max_replication_slots)",
                )
            })?;
        let text: String = row.get(0);
        tracing::info!(slot, lsn = %text, "created the replication slot");
        parse_lsn(&text).ok_or_else(|| Error::source(format!("slot LSN {text:?} is not an LSN")))
    }

    /// The slot's `confirmed_flush_lsn`; `None` if there is no such slot. A slot of another plugin is
    /// an error.
    pub async fn slot_confirmed(&self, slot: &str) -> Result<Option<u64>> {
        let row = self
            .client
            .query_opt(
                "SELECT plugin, confirmed_flush_lsn::text FROM pg_replication_slots \
                 WHERE slot_name = $1 AND database = current_database()",
                &[&slot],
            )
            .await
            .map_err(|e| self.failed("reading pg_replication_slots", e))?;
        let Some(row) = row else { return Ok(None) };
        let plugin: Option<String> = row.get(0);
        if plugin.as_deref() != Some("pgoutput") {
            return Err(Error::source(format!(
                "replication slot {slot} uses plugin {}, not pgoutput",
                plugin.unwrap_or_default()
            ))
            .remedy("set source.slot to another name (outboxd creates it), or drop that slot"));
        }
        let lsn: Option<String> = row.get(1);
        Ok(lsn.as_deref().and_then(parse_lsn).or(Some(0)))
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

    /// The server's current WAL position (primary) or replay position (standby).
    pub async fn current_lsn(&self) -> Result<u64> {
        let row = self
            .client
            .query_one(
                "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END)::text",
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
