//! Postgres preflight: logical WAL, the REPLICATION attribute, the slot, the publication and the tables.

use super::control::{
    quote_table, refuses_plain_text, ConnInfo, Control, Server, SlotState, FAILOVER_SLOTS,
    STANDBY_DECODING,
};
use super::lsn::lsn_to_string;
use super::socket::Protection;
use super::stream::Connection;
use crate::preflight::{routed_columns_item, Item};
use crate::source::config::{PostgresOptions, SourceConfig, TlsMode};
use crate::source::Position;

const SUBJECT: &str = "postgres";

/// Checks the server behind `config` (its first host) for what outboxd needs; `checkpoint` is the
/// stored position, `wanted` the columns the route reads, `several` whether `source.url` lists
/// more hosts (a primary and its standbys, for failover).
pub async fn preflight(
    config: &SourceConfig,
    own: &PostgresOptions,
    checkpoint: Option<&Position>,
    wanted: &[String],
    several: bool,
) -> Vec<Item> {
    let mut items = Vec::new();
    let info = match ConnInfo::from_config(config) {
        Ok(i) => i,
        Err(e) => {
            items.push(failed(&e));
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
            items.push(failed(&e));
            return items;
        }
    };
    items.push(tls_item(&control, &info).await);
    let server = match control.server().await {
        Ok(server) => server,
        Err(e) => {
            items.push(failed(&e));
            return items;
        }
    };
    let read = (wanted, several);
    if let Err(e) = check(&control, &server, config, own, checkpoint, read, &mut items).await {
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
    server: &Server,
    config: &SourceConfig,
    own: &PostgresOptions,
    checkpoint: Option<&Position>,
    (wanted, several): (&[String], bool),
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
    slot_items(control, server, own, checkpoint, several, max_slots, items).await?;
    items.extend(super::heartbeat::items(config, own, server, control, SUBJECT).await);
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
        let unsent = super::published::item(client, server, table, publication, wanted, SUBJECT);
        items.extend(unsent.await?);
        let state = control.publication_state(publication, table).await?;
        if !exists && server.standby {
            let problem =
                format!("publication {publication} does not exist, and a standby cannot create it");
            let fix = format!(
                "run on the primary: {}",
                super::control::create_publication_sql(publication, &config.tables)
            );
            // Listed beside its primary, the standby gets it from the primary, where run creates it.
            items.push(if several {
                Item::warn(
                    SUBJECT,
                    format!("{problem} (run creates it on the primary)"),
                    fix,
                )
            } else {
                Item::fail(SUBJECT, problem, fix)
            });
            continue;
        }
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

/// An error that ends the checks, as a FAIL line with its remedy.
fn failed(e: &crate::error::Error) -> Item {
    Item::fail(SUBJECT, e.message(), e.remedy_text().unwrap_or(""))
}

/// The slot's lines: it exists (or will be made), holds the changes since the checkpoint, and, where
/// standbys are involved, survives a promotion (see `failover_items`).
async fn slot_items(
    control: &Control,
    server: &Server,
    own: &PostgresOptions,
    checkpoint: Option<&Position>,
    several: bool,
    max_slots: i32,
    items: &mut Vec<Item>,
) -> Result<(), tokio_postgres::Error> {
    let name = &own.slot;
    let slot = match control.slot(name).await {
        Ok(slot) => slot,
        Err(e) => {
            items.push(failed(&e));
            return Ok(());
        }
    };
    let checkpoint_lsn = checkpoint.and_then(|c| c.lsn().ok()).map(|l| l.0);
    if server.standby && server.number < STANDBY_DECODING {
        let problem = format!("this server is a standby of PostgreSQL {}, which cannot decode logically (that came in 16)", server.version);
        let fix = "point source.url at the primary (list it first, with its standbys after it for failover), or upgrade to 16 or later to read a standby";
        items.push(if several {
            // A session refuses this host and moves on; it takes over once promoted.
            Item::warn(
                SUBJECT,
                format!("{problem}: a session here is refused until it is promoted"),
                fix,
            )
        } else {
            Item::fail(SUBJECT, problem, fix)
        });
        return Ok(());
    }
    match (slot.clone(), checkpoint_lsn) {
        (Some(s), _) if s.synced && server.standby => {
            if !several {
                items.push(Item::fail(
                    SUBJECT,
                    format!("this server is a standby, and slot {name} here is a synchronized copy of the primary's failover slot: Postgres lets it be read only after a promotion"),
                    "list the primary in source.url as well: outboxd reads the primary, and continues here from the copy after a promotion",
                ));
            }
        }
        (Some(s), Some(_)) if s.invalidated.is_some() => items.push(Item::fail(
            SUBJECT,
            format!("slot {name} is invalidated ({}): the changes since the checkpoint cannot be decoded from it", s.invalidated.clone().unwrap_or_default()),
            "drop it, `outboxd checkpoint reset` and start outboxd, then re-send what came before with `outboxd snapshot --where …`; keep max_slot_wal_keep_size large enough",
        )),
        (Some(s), Some(lsn)) if s.confirmed > lsn => items.push(Item::warn(
            SUBJECT,
            format!(
                "slot {name} is ahead of the checkpoint ({} > {}): an older copy of the checkpoint (run starts at the slot: those rows were forwarded), or the slot was consumed elsewhere; on a server promoted since the checkpoint run refuses it",
                lsn_to_string(s.confirmed),
                lsn_to_string(lsn)
            ),
            format!("make sure only this pipeline uses the slot; to accept the slot's position, `outboxd checkpoint set {}`", lsn_to_string(s.confirmed)),
        )),
        (Some(s), _) => items.push(Item::pass(
            SUBJECT,
            format!("slot {name} exists (pgoutput, confirmed {})", lsn_to_string(s.confirmed)),
        )),
        (None, Some(lsn)) if several => items.push(Item::warn(
            SUBJECT,
            format!("slot {name} is not on this server, but a checkpoint is (at {}): a session here is refused, and outboxd moves on to the next host", lsn_to_string(lsn)),
            "if this server is to take over after a failover, make it keep a synchronized copy of the slot (see the failover lines)",
        )),
        (None, Some(lsn)) => items.push(Item::fail(
            SUBJECT,
            format!("slot {name} does not exist, but a checkpoint does (at {}): the changes since then went with the slot", lsn_to_string(lsn)),
            "list the server that has the slot in source.url; otherwise `outboxd checkpoint reset` and start outboxd (it makes a new slot now), then re-send what came before with `outboxd snapshot --where …`",
        )),
        (None, None) => {
            let used: i64 = control
                .client()
                .query_one("SELECT count(*) FROM pg_replication_slots", &[])
                .await?
                .get(0);
            if used >= max_slots as i64 {
                items.push(Item::fail(
                    SUBJECT,
                    format!("slot {name} does not exist and all {max_slots} slots are in use"),
                    "raise max_replication_slots (restart needed) or drop an unused slot",
                ));
            } else if server.standby && several {
                // failover_items says what this standby lacks.
            } else {
                let kind = if server.failover_slots() { " (a failover slot)" } else { "" };
                let wait = if server.standby { "; on a standby that waits for the primary's next record of running transactions (`SELECT pg_log_standby_snapshot()` on the primary writes one)" } else { "" };
                items.push(Item::pass(
                    SUBJECT,
                    format!("slot {name} will be created at start{kind}{wait}"),
                ));
            }
        }
    }
    failover_items(control, server, name, slot, several, items).await
}

/// Whether a promotion keeps the slot. A primary (17+) with standbys, or listed with other hosts:
/// the slot must be a failover slot, and `synchronized_standby_slots` must name the standbys (or a
/// promoted standby may lack changes outboxd already forwarded); before 17 there are no failover
/// slots. A standby listed for failover: it must keep a synchronized copy that is persistent (a
/// copy stays `temporary` until the primary's slot has advanced past the standby's catalog xmin, and
/// a temporary one is gone after a promotion).
async fn failover_items(
    control: &Control,
    server: &Server,
    name: &str,
    slot: Option<SlotState>,
    several: bool,
    items: &mut Vec<Item>,
) -> Result<(), tokio_postgres::Error> {
    let client = control.client();
    if server.standby {
        let feedback: String = client
            .query_one("SELECT current_setting('hot_standby_feedback')", &[])
            .await?
            .get(0);
        if feedback != "on" {
            items.push(Item::warn(
                SUBJECT,
                "hot_standby_feedback is off on this standby: the primary may remove catalog rows a slot here still needs (Postgres then invalidates the slot), and slots are not synchronized",
                "ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf();",
            ));
        }
        if !several {
            return Ok(());
        }
        let sync_fix = "on this standby: sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name set and a dbname in primary_conninfo (PostgreSQL 17+); on the primary the slot a failover slot";
        match slot {
            Some(s) if s.synced && s.invalidated.is_some() => items.push(Item::warn(
                SUBJECT,
                format!("the copy of slot {name} on this standby is invalidated ({}): a promotion could not continue from it", s.invalidated.clone().unwrap_or_default()),
                "set hot_standby_feedback = on and primary_slot_name on this standby; drop the copy (after a promotion) so it is synchronized anew",
            )),
            Some(s) if s.synced && s.temporary => items.push(Item::warn(
                SUBJECT,
                format!("the copy of slot {name} on this standby is not persistent yet (temporary): a promotion now would lose it"),
                "it persists once the primary's slot has advanced past this standby's catalog xmin: let outboxd forward rows for a while (SELECT synced, temporary FROM pg_replication_slots shows it)",
            )),
            Some(s) if s.synced => items.push(Item::pass(
                SUBJECT,
                format!("slot {name} here is a synchronized copy of the primary's failover slot: after a promotion outboxd continues from it"),
            )),
            Some(_) => items.push(Item::warn(
                SUBJECT,
                format!("slot {name} on this standby is its own, not a copy of the primary's: outboxd would read this standby through it when the primary is down"),
                "drop it here (SELECT pg_drop_replication_slot(…)) and let the standby synchronize the primary's failover slot",
            )),
            None => items.push(Item::warn(
                SUBJECT,
                format!("slot {name} is not on this standby: after a promotion outboxd refuses to continue here (the changes since the checkpoint would be gone)"),
                sync_fix,
            )),
        }
        return Ok(());
    }
    let standbys: i64 = client
        .query_one(
            "SELECT (SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'physical') + \
             (SELECT count(*) FROM pg_stat_replication r WHERE NOT EXISTS \
               (SELECT 1 FROM pg_replication_slots s WHERE s.active_pid = r.pid AND s.slot_type = 'logical'))",
            &[],
        )
        .await?
        .get(0);
    if standbys == 0 && !several {
        return Ok(());
    }
    if server.number < FAILOVER_SLOTS {
        items.push(Item::warn(
            SUBJECT,
            format!("PostgreSQL {} has no failover slots: a promoted standby has no copy of slot {name}, and outboxd refuses to continue there", server.version),
            "PostgreSQL 17+ keeps failover slots on standbys; until then, after a failover re-send what the outbox got since the checkpoint with `outboxd snapshot --where …`",
        ));
        return Ok(());
    }
    match slot {
        Some(s) if !s.failover => items.push(Item::warn(
            SUBJECT,
            format!("slot {name} is not a failover slot: a promoted standby has no copy of it, and outboxd refuses to continue there"),
            format!("psql \"dbname=… replication=database\" -c 'ALTER_REPLICATION_SLOT \"{name}\" (FAILOVER true)'; on the standbys sync_replication_slots = on"),
        )),
        Some(_) => items.push(Item::pass(SUBJECT, format!("slot {name} is a failover slot"))),
        None => {}
    }
    let synchronized: String = client
        .query_one("SELECT current_setting('synchronized_standby_slots')", &[])
        .await?
        .get(0);
    if synchronized.trim().is_empty() {
        items.push(Item::warn(
            SUBJECT,
            "synchronized_standby_slots is empty: outboxd may forward changes a standby has not received, and a promoted standby never had them (and its copy of the slot may lag)",
            "ALTER SYSTEM SET synchronized_standby_slots = '<the standbys' physical slots>'; SELECT pg_reload_conf();",
        ));
    } else {
        items.push(Item::pass(
            SUBJECT,
            format!("synchronized_standby_slots = '{synchronized}': outboxd is sent only what those standbys have"),
        ));
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
