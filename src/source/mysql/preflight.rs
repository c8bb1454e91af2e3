//! MySQL/MariaDB preflight: the server settings, privileges and tables outboxd depends on.

use mysql_async::prelude::Queryable;
use mysql_async::Conn;

use crate::source::config::TlsMode;
use crate::source::tls::TlsSettings;

use super::connect::{map_err, open_raw, ConnectFailure};
use super::replica::{logs_replicated_rows, without_updates, Replication};
use super::{BinlogPosition, ServerInfo};
use crate::preflight::{routed_columns_item, Item};
use crate::source::config::{redact_url, SourceConfig};
use crate::source::Position;

const SUBJECT: &str = "mysql";

/// Checks the server behind `config` (its first host) for what outboxd needs; `checkpoint` is the
/// stored position, `wanted` the columns the route reads.
pub async fn preflight(
    config: &SourceConfig,
    checkpoint: Option<&Position>,
    wanted: &[String],
) -> Vec<Item> {
    let mut items = Vec::new();
    let server = redact_url(&config.url);
    let connect = tokio::time::timeout(std::time::Duration::from_secs(10), open_raw(config)).await;
    let mut conn = match connect {
        Ok(Ok(conn)) => conn,
        Ok(Err(failure)) => {
            let e = match failure {
                ConnectFailure::Explained(e) => e,
                ConnectFailure::Driver(e) => map_err(e, config),
            };
            let remedy = e
                .remedy_text()
                .unwrap_or("check source.url and the user's account on the server");
            items.push(if e.is_transient() {
                Item::unreachable(SUBJECT, e.message().to_string(), remedy)
            } else {
                Item::fail(SUBJECT, e.message().to_string(), remedy)
            });
            return items;
        }
        Err(_) => {
            items.push(Item::unreachable(
                SUBJECT,
                format!("{server} did not answer within 10 s"),
                "check that the server is up and reachable",
            ));
            return items;
        }
    };
    items.push(tls_item(&mut conn, config).await);
    match check_server(&mut conn, config, checkpoint, wanted, &mut items).await {
        Ok(()) => {}
        Err(e) => items.push(Item::unreachable(
            SUBJECT,
            format!("checking {server} failed: {e}"),
            "check the server and the user's SELECT privilege",
        )),
    }
    let _ = conn.disconnect().await;
    items
}

async fn check_server(
    conn: &mut Conn,
    config: &SourceConfig,
    checkpoint: Option<&Position>,
    wanted: &[String],
    items: &mut Vec<Item>,
) -> mysql_async::Result<()> {
    let info = ServerInfo::read(conn).await?;
    items.push(Item::pass(
        SUBJECT,
        format!(
            "connected to {} (server_id {})",
            info.version, info.server_id
        ),
    ));
    for setting in info.binlog_settings() {
        items.push(match setting.ok {
            true => Item::pass(SUBJECT, setting.shown),
            false => Item::fail(SUBJECT, setting.problem, setting.remedy),
        });
    }
    let metadata: Option<String> = conn
        .query_first("SELECT @@binlog_row_metadata")
        .await
        .ok()
        .flatten();
    match metadata.as_deref() {
        Some(m) if m.eq_ignore_ascii_case("FULL") => {
            items.push(Item::pass(SUBJECT, "binlog_row_metadata = FULL"))
        }
        Some(m) => items.push(Item::warn(
            SUBJECT,
            format!("binlog_row_metadata = {m}: column names come from information_schema, which is wrong across ALTER TABLE"),
            "SET GLOBAL binlog_row_metadata = 'FULL'; and in the server's config file",
        )),
        None => {}
    }
    if info.is_mariadb {
        let compress: Option<u8> = conn
            .query_first("SELECT @@log_bin_compress")
            .await
            .ok()
            .flatten();
        if compress == Some(1) {
            items.push(Item::fail(
                SUBJECT,
                "log_bin_compress = ON: compressed row events cannot be decoded",
                "SET GLOBAL log_bin_compress = OFF; and in the server's config file",
            ));
        } else {
            items.push(Item::pass(SUBJECT, "log_bin_compress = OFF"));
        }
    }
    check_replica(conn, &info, items).await;
    check_grants(conn, items).await;
    check_checkpoint(conn, checkpoint, items).await;
    check_tables(conn, config, wanted, items).await?;
    Ok(())
}

/// A replica only writes replicated transactions to its own binlog with log_slave_updates.
async fn check_replica(conn: &mut Conn, info: &ServerInfo, items: &mut Vec<Item>) {
    let Replication { is_replica, status } = Replication::read(conn).await;
    if !is_replica {
        items.push(Item::pass(SUBJECT, "not a replica"));
        return;
    }
    if logs_replicated_rows(conn).await == Some(true) {
        let variable = if info.is_mariadb {
            "log_slave_updates"
        } else {
            "log_replica_updates"
        };
        items.push(Item::pass(SUBJECT, format!("replica with {variable} = ON")));
    } else {
        let (problem, remedy) = without_updates(info.is_mariadb);
        items.push(Item::fail(SUBJECT, problem, remedy));
    }
    let Some(status) = status else {
        items.push(Item::warn(
            SUBJECT,
            "cannot read the replica's status: replication state and lag unknown, and a replica that stops replicating is not noticed (outboxd would wait on it for new rows instead of moving to the next host)",
            "GRANT SLAVE MONITOR (MariaDB) / REPLICATION CLIENT (MySQL) to the outboxd user",
        ));
        return;
    };
    let field = |names: &[&str]| -> Option<String> {
        names.iter().find_map(|n| {
            status
                .get_opt::<Option<String>, _>(*n)
                .and_then(|r| r.ok())
                .flatten()
        })
    };
    let io = field(&["Replica_IO_Running", "Slave_IO_Running"]);
    let sql = field(&["Replica_SQL_Running", "Slave_SQL_Running"]);
    if io.as_deref() != Some("Yes") || sql.as_deref() != Some("Yes") {
        items.push(Item::warn(
            SUBJECT,
            format!(
                "replication is not running (IO: {}, SQL: {}): new rows from the primary will not arrive",
                io.unwrap_or_default(),
                sql.unwrap_or_default()
            ),
            "START REPLICA (START SLAVE on MariaDB) and check SHOW REPLICA STATUS",
        ));
    } else if let Some(lag) = field(&["Seconds_Behind_Source", "Seconds_Behind_Master"]) {
        items.push(Item::pass(
            SUBJECT,
            format!("replication running, {lag} s behind"),
        ));
    }
}

async fn check_grants(conn: &mut Conn, items: &mut Vec<Item>) {
    let grants: Vec<String> = conn
        .query("SHOW GRANTS FOR CURRENT_USER()")
        .await
        .unwrap_or_default();
    let all = grants.join("\n").to_ascii_uppercase();
    let global = |p: &str| {
        grants.iter().any(|g| {
            let g = g.to_ascii_uppercase();
            g.contains(" ON *.* ") && (g.contains(p) || g.contains("ALL PRIVILEGES"))
        })
    };
    let slave = global("REPLICATION SLAVE") || global("REPLICATION REPLICA");
    let client = global("REPLICATION CLIENT") || global("BINLOG MONITOR") || global("SUPER");
    if slave && client {
        items.push(Item::pass(SUBJECT, "the user may read the binlog"));
    } else {
        let _ = all;
        items.push(Item::fail(
            SUBJECT,
            format!(
                "the user lacks{}{} (grants: {})",
                if slave { "" } else { " REPLICATION SLAVE" },
                if client { "" } else { " REPLICATION CLIENT/BINLOG MONITOR" },
                grants.join("; ")
            ),
            "GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO the outboxd user (MariaDB: also BINLOG MONITOR, SLAVE MONITOR)",
        ));
    }
}

async fn check_checkpoint(conn: &mut Conn, checkpoint: Option<&Position>, items: &mut Vec<Item>) {
    let Some(checkpoint) = checkpoint else { return };
    let Ok(position) = checkpoint.binlog() else {
        items.push(Item::fail(
            SUBJECT,
            "the checkpoint does not hold a binlog position",
            "point checkpoint.dir/name at this pipeline's checkpoint",
        ));
        return;
    };
    let logs: Vec<mysql_async::Row> = conn.query("SHOW BINARY LOGS").await.unwrap_or_default();
    let names: Vec<String> = logs.iter().filter_map(|r| r.get::<String, _>(0)).collect();
    if names.contains(&position.file) {
        items.push(Item::pass(
            SUBJECT,
            format!("the checkpoint's binlog {} is on the server", position.file),
        ));
    } else if position.resumes_by_gtid(true) || position.resumes_by_gtid(false) {
        // A position typed as a GTID names no file at all.
        let file = if position.file.is_empty() {
            "(none: a GTID position)".to_string()
        } else {
            position.file.clone()
        };
        items.push(Item::warn(
            SUBJECT,
            format!("binlog {file} is not on this server; resuming relies on GTID {}", position.gtid_text().unwrap_or_default()),
            "fine after a failover; if the server purged those GTIDs, restore the binlogs or set the checkpoint deliberately",
        ));
    } else {
        items.push(Item::fail(
            SUBJECT,
            format!("the checkpoint's binlog {} is no longer on the server (oldest: {})", position.file, names.first().cloned().unwrap_or_default()),
            "restore the purged binlogs (outboxd replay from a backup), or move the checkpoint deliberately with `outboxd checkpoint set`",
        ));
    }
    check_purged_gtids(conn, position, items).await;
}

/// MySQL: transactions the checkpoint has not seen that the server already purged are gone from
/// its binlog: a GTID resume there is refused (and would lose them anywhere they are not kept).
async fn check_purged_gtids(conn: &mut Conn, position: &BinlogPosition, items: &mut Vec<Item>) {
    let Some(set) = position.mysql_gtids.as_ref().filter(|s| !s.is_empty()) else {
        return;
    };
    let purged: Option<String> = conn
        .exec_first::<Option<String>, _, _>(
            "SELECT GTID_SUBTRACT(@@GLOBAL.gtid_purged, ?)",
            (set.to_string(),),
        )
        .await
        .ok()
        .flatten()
        .flatten();
    let missing: String = purged.unwrap_or_default().split_whitespace().collect();
    if !missing.is_empty() {
        items.push(Item::fail(
            SUBJECT,
            format!("the server purged transactions the checkpoint has not delivered yet: {missing}"),
            "read a server that still has them (another host in source.url), restore the binlogs holding them (outboxd replay --binlog-file), or move the checkpoint deliberately with `outboxd checkpoint set`",
        ));
    }
}

async fn check_tables(
    conn: &mut Conn,
    config: &SourceConfig,
    wanted: &[String],
    items: &mut Vec<Item>,
) -> mysql_async::Result<()> {
    for table in &config.tables {
        let (schema, name) = table.split_once('.').unwrap_or(("", table));
        let columns: Vec<String> = conn
            .exec(
                "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ?",
                (schema, name),
            )
            .await?;
        items.push(routed_columns_item(
            SUBJECT, table, &columns, wanted, "mysql",
        ));
    }
    Ok(())
}

/// The TLS line: the protocol the server reports for this connection and what was verified.
async fn tls_item(conn: &mut Conn, config: &SourceConfig) -> Item {
    let settings = match TlsSettings::of(config) {
        Ok(s) => s,
        Err(e) => {
            return Item::fail(
                SUBJECT,
                e.message().to_string(),
                e.remedy_text().unwrap_or(""),
            )
        }
    };
    let host = conn.opts().ip_or_hostname().to_string();
    // Our side: TLS options stay on the connection unless `prefer` fell back to plain text.
    let encrypted = conn.opts().ssl_opts().is_some();
    let version: Option<(String, String)> = conn
        .query_first("SHOW SESSION STATUS LIKE 'Ssl_version'")
        .await
        .ok()
        .flatten();
    let version = version
        .map(|(_, v)| v)
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "(version not reported)".into());
    if encrypted {
        Item::pass(
            SUBJECT,
            format!(
                "TLS {version} on every connection to {host} ({})",
                settings.describe(&host)
            ),
        )
    } else if settings.mode == TlsMode::Disable {
        Item::warn(
            SUBJECT,
            format!("connections to {host} are plain text (source.tls is off)"),
            "outside a trusted network set source.tls = { mode = \"verify-full\", ca = \"/path/ca.pem\" } (docs/sources/tls.md)",
        )
    } else {
        Item::warn(
            SUBJECT,
            format!("the server at {host} does not offer TLS; connections are plain text (source.tls mode prefer)"),
            "enable TLS on the server (ssl_cert, ssl_key) and set source.tls.mode = \"verify-full\"",
        )
    }
}
