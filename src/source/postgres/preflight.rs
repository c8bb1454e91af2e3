//! Postgres preflight: logical WAL, the REPLICATION attribute, the slot, the publication and the tables.

use super::control::{quote_table, refuses_plain_text, ConnInfo, Control};
use super::lsn::{lsn_to_string, parse_lsn};
use super::socket::Protection;
use super::stream::Connection;
use crate::preflight::{routed_columns_item, Item};
use crate::source::config::{PostgresOptions, SourceConfig, TlsMode};
use crate::source::Position;

const SUBJECT: &str = "postgres";

/// Checks the server behind `config` for what outboxd needs; `checkpoint` is the stored position,
/// `wanted` the columns the route reads.
pub async fn preflight(
    config: &SourceConfig,
    own: &PostgresOptions,
    checkpoint: Option<&Position>,
    wanted: &[String],
) -> Vec<Item> {
    let mut items = Vec::new();
    let info = match ConnInfo::from_config(config) {
        Ok(i) => i,
        Err(e) => {
            items.push(Item::fail(
                SUBJECT,
                e.message(),
                e.remedy_text().unwrap_or(""),
            ));
            return items;
        }
    };
    let control = match Control::connect(&info).await {
        Ok(c) => c,
        Err(e) if e.is_transient() => {
            items.push(Item::unreachable(
                SUBJECT,
                e.message(),
                "start the server or fix source.url",
            ));
            return items;
        }
        Err(e) => {
            items.push(Item::fail(
                SUBJECT,
                e.message(),
                e.remedy_text().unwrap_or(""),
            ));
            return items;
        }
    };
    items.push(tls_item(&control, &info).await);
    if let Err(e) = control.refuse_unsupported().await {
        items.push(Item::fail(
            SUBJECT,
            e.message(),
            e.remedy_text().unwrap_or(""),
        ));
        return items;
    }
    if let Err(e) = check(&control, config, own, checkpoint, wanted, &mut items).await {
        items.push(Item::unreachable(
            SUBJECT,
            format!("checking {} failed: {e}", info.shown),
            "check the server and the user's privileges",
        ));
    }
    items
}

async fn check(
    control: &Control,
    config: &SourceConfig,
    own: &PostgresOptions,
    checkpoint: Option<&Position>,
    wanted: &[String],
    items: &mut Vec<Item>,
) -> Result<(), tokio_postgres::Error> {
    let client = control.client();
    let row = client
        .query_one(
            "SELECT version(), current_setting('wal_level'), current_setting('max_replication_slots')::int, \
             (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user)",
            &[],
        )
        .await?;
    let (version, wal_level, max_slots, replication): (String, String, i32, bool) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    items.push(Item::pass(
        SUBJECT,
        format!(
            "connected to {}",
            version.split(',').next().unwrap_or(&version)
        ),
    ));
    if wal_level == "logical" {
        items.push(Item::pass(SUBJECT, "wal_level = logical"));
    } else {
        items.push(Item::fail(
            SUBJECT,
            format!("wal_level = {wal_level}: logical decoding is off"),
            "ALTER SYSTEM SET wal_level = logical; then restart Postgres",
        ));
    }
    if replication {
        items.push(Item::pass(
            SUBJECT,
            "the user has the REPLICATION attribute",
        ));
    } else {
        items.push(Item::fail(
            SUBJECT,
            "the user lacks the REPLICATION attribute",
            "ALTER ROLE <user> WITH REPLICATION;",
        ));
    }
    let read_stats: bool = client
        .query_one(
            "SELECT pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')",
            &[],
        )
        .await?
        .get(0);
    if read_stats {
        items.push(Item::pass(
            SUBJECT,
            "the user may see its walsender's progress (pg_read_all_stats)",
        ));
    } else {
        items.push(Item::warn(
            SUBJECT,
            "the user cannot see its walsender's progress: a stream silent while the server decodes a large transaction is given wal_sender_timeout, not more, before outboxd reconnects",
            "GRANT pg_read_all_stats TO <user>; (optional: lets outboxd wait for a walsender that is still reading WAL)",
        ));
    }
    let slot = &own.slot;
    let slot_row = client
        .query_opt(
            "SELECT plugin, confirmed_flush_lsn::text, active FROM pg_replication_slots WHERE slot_name = $1",
            &[slot],
        )
        .await?;
    match slot_row {
        Some(r) => {
            let plugin: Option<String> = r.get(0);
            let confirmed: Option<String> = r.get(1);
            if plugin.as_deref() == Some("pgoutput") {
                items.push(Item::pass(
                    SUBJECT,
                    format!(
                        "slot {slot} exists (pgoutput, confirmed {})",
                        confirmed.clone().unwrap_or_default()
                    ),
                ));
            } else {
                items.push(Item::fail(
                    SUBJECT,
                    format!("slot {slot} uses plugin {}", plugin.unwrap_or_default()),
                    "set source.slot to another name (outboxd creates it) or drop that slot",
                ));
            }
            if let (Some(c), Some(cp)) = (confirmed.as_deref().and_then(parse_lsn), checkpoint) {
                if let Ok(super::Lsn(lsn)) = cp.lsn() {
                    if c > lsn {
                        items.push(Item::warn(
                            SUBJECT,
                            format!("slot {slot} is ahead of the checkpoint ({} > {}): changes in between were consumed elsewhere", lsn_to_string(c), lsn_to_string(lsn)),
                            "make sure only this outboxd pipeline uses the slot",
                        ));
                    }
                }
            }
        }
        None => {
            let used: i64 = client
                .query_one("SELECT count(*) FROM pg_replication_slots", &[])
                .await?
                .get(0);
            if used < max_slots as i64 {
                items.push(Item::pass(
                    SUBJECT,
                    format!("slot {slot} will be created at start"),
                ));
            } else {
                items.push(Item::fail(
                    SUBJECT,
                    format!("slot {slot} does not exist and all {max_slots} slots are in use"),
                    "raise max_replication_slots (restart needed) or drop an unused slot",
                ));
            }
        }
    }
    let publication = &own.publication;
    let publication_row = client
        .query_opt(
            "SELECT puballtables, pubviaroot FROM pg_publication WHERE pubname = $1",
            &[publication],
        )
        .await?;
    let exists = publication_row.is_some();
    let (all_tables, via_root) = publication_row
        .map(|r| (r.get::<_, bool>(0), r.get::<_, bool>(1)))
        .unwrap_or((false, true));
    for table in &config.tables {
        let (schema, name) = super::control::split_table(table);
        let columns: Vec<String> = client
            .query(
                "SELECT column_name::text FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2",
                &[&schema, &name],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let item = routed_columns_item(SUBJECT, table, &columns, wanted, "postgres");
        let missing_table = columns.is_empty();
        items.push(item);
        if missing_table {
            continue;
        }
        let state = control.publication_state(publication, table).await?;
        if !exists {
            items.push(Item::pass(SUBJECT, format!("publication {publication} will be created for {table} at start (needs table ownership)")));
            continue;
        }
        if state.partitioned && !via_root {
            items.push(Item::fail(
                SUBJECT,
                format!("{table} is partitioned and publication {publication} sends its rows under the partitions' names (publish_via_partition_root is off)"),
                super::control::via_root_sql(publication),
            ));
        } else if state.published || all_tables {
            items.push(Item::pass(
                SUBJECT,
                format!("{table} is in publication {publication}"),
            ));
        } else {
            items.push(Item::fail(
                SUBJECT,
                format!("{table} is not in publication {publication}"),
                format!(
                    "ALTER PUBLICATION \"{publication}\" ADD TABLE {};",
                    quote_table(table)
                ),
            ));
        }
    }
    Ok(())
}

/// The TLS line: the protocol of the control connection (`pg_stat_ssl`) and what was verified; the
/// replication connection is opened too, since pg_hba.conf may treat it differently.
async fn tls_item(control: &Control, info: &ConnInfo) -> Item {
    let mode = info
        .tls
        .as_ref()
        .map_or(TlsMode::Disable, |t| t.settings.mode);
    let probe = tokio::time::timeout(std::time::Duration::from_secs(15), Connection::open(info));
    match probe.await.unwrap_or_else(|_| {
        Err(crate::error::Error::source(format!(
            "{}: the login did not finish within 15 s",
            info.shown
        ))
        .transient())
    }) {
        Ok(conn) => conn.close().await,
        Err(e) if e.is_transient() => {
            return Item::unreachable(
                SUBJECT,
                format!("replication connection: {}", e.message()),
                e.remedy_text()
                    .unwrap_or("start the server or fix source.url"),
            )
        }
        // Privileges and pg_hba.conf lines are judged by the checks below; this one is about TLS.
        Err(e)
            if !(e.message().contains("TLS")
                || e.message().contains("certificate")
                || refuses_plain_text(e.message())) => {}
        Err(e) => {
            return Item::fail(
                SUBJECT,
                format!("replication connection: {}", e.message()),
                e.remedy_text().unwrap_or(""),
            )
        }
    }
    let settings = info.tls.as_ref().map(|t| &t.settings);
    match (control.protection, control.tls_in_use().await) {
        (Protection::Tls, Ok(server_view)) => {
            let protocol = match server_view {
                Some((version, cipher)) => format!("TLS {version} ({cipher})"),
                None => "TLS on outboxd's side (the server reports none: a proxy ends it)".into(),
            };
            Item::pass(
                SUBJECT,
                format!(
                    "{protocol} on the control and replication connections to {} ({})",
                    info.host,
                    settings.map(|s| s.describe(&info.host)).unwrap_or_default()
                ),
            )
        }
        (Protection::Plain, Ok(_)) if mode == TlsMode::Disable => Item::warn(
            SUBJECT,
            format!("connections to {} are plain text (source.tls is off)", info.host),
            "outside a trusted network set source.tls = { mode = \"verify-full\", ca = \"/path/ca.pem\" } (docs/sources/tls.md)",
        ),
        (Protection::Plain, Ok(_)) => Item::warn(
            SUBJECT,
            format!("the server at {} does not offer TLS; connections are plain text (source.tls mode prefer)", info.host),
            "enable TLS on the server (ssl = on) and set source.tls.mode = \"verify-full\"",
        ),
        (_, Err(e)) => Item::unreachable(SUBJECT, e.message().to_string(), "check the server"),
    }
}
