//! Reading Postgres outbox tables for a snapshot (see [`crate::source::snapshot`]).
//!
//! On a first start the replication slot is created with `EXPORT_SNAPSHOT`: its consistent point
//! is where streaming starts, and the snapshot it exports sees exactly the transactions committed
//! before that point. A control connection imports it into a `REPEATABLE READ` transaction held for
//! the whole read. If the slot exists already (created by hand, or by an earlier run that never
//! checkpointed), no snapshot can be exported for its position; the read then uses a fresh view,
//! which sees everything the slot would send again too: no row is missing, rows committed since
//! the slot's position arrive twice (a warning says so).
//!
//! Chunks select every column in its type's text output form (exactly what pgoutput sends) and convert it
//! with the decoder's own conversion, so a snapshot row and a streamed row of the same data become
//! the same record. Keys travel as text and are compared after a cast to the key's own type.

use std::collections::HashMap;
use std::sync::Arc;

use tokio_postgres::types::ToSql;
use tokio_postgres::Statement;

use super::control::{quote_ident, quote_table, Control};
use super::stream::Connection;
use super::{position, within};
use crate::error::{Error, Result};
use crate::source::config::{PostgresOptions, SourceConfig, SourceKind};
use crate::source::snapshot::{check_key_width, Begun, KeyValue, KeyedRow, TableReader};
use crate::source::{SourceIdentity, Value};

/// A table as the snapshot reads it.
struct Plan {
    table: Arc<str>,
    names: Arc<[Arc<str>]>,
    types: Vec<u32>,
    keys: usize,
    first: Statement,
    next: Statement,
}

pub struct Reader {
    control: Control,
    /// Whether the publication sends stored generated columns (so the snapshot reads them too).
    generated: bool,
    plans: HashMap<(String, Option<String>, usize), Plan>,
}

/// Opens the snapshot transaction; with `exact`, in the snapshot exported by a new slot whose
/// consistent point is `then` (see the module docs), otherwise `then` is the current WAL end.
pub async fn begin(config: &SourceConfig, own: &PostgresOptions, exact: bool) -> Result<Begun> {
    let (info, control) = Control::connect_primary(config).await?;
    let generated = super::published::stored_generated_sent(control.client(), &own.publication)
        .await
        .map_err(|e| control.failed("reading the publication", e))?;
    if !exact {
        let then = control.current_lsn().await?;
        // Which cluster this is (IDENTIFY_SYSTEM, as the stream asks; else `pg_control_system()`,
        // which can be revoked): `outboxd audit` then tells a checkpoint of another cluster from
        // one of this.
        let identified = async {
            let mut conn = within(Connection::open(&info), &info.shown).await.ok()?;
            within(conn.identify_system(), &info.shown).await.ok()
        };
        let system_identifier = match identified.await {
            Some(system) => Some(system.id),
            None => control.system_identifier().await.ok(),
        };
        let identity = SourceIdentity {
            system_identifier,
            ..SourceIdentity::anonymous(SourceKind::Postgres)
        };
        open_read(&control, None).await?;
        return Ok(Begun {
            reader: TableReader::Postgres(Reader {
                control,
                generated,
                plans: HashMap::new(),
            }),
            identity,
            then: position(then),
        });
    }
    let server = control.server().await?;
    if server.standby && config.one_of_several {
        // As for a stream (`usable_slot`): beside its primary, a standby gets no slot.
        return Err(Error::source(format!(
            "{} is a standby: with several hosts in source.url, outboxd makes its slot (and the first start's snapshot) on the primary",
            info.shown
        ))
        .remedy("nothing while the primary is up: outboxd reads it")
        .refused_by_host());
    }
    // The publication must exist before the slot: pgoutput reads it as of each change's time.
    control
        .ensure_publication_on(&server, &own.publication, &config.tables)
        .await?;
    let mut conn = within(Connection::open(&info), &info.shown).await?;
    let system = within(conn.identify_system(), &info.shown).await?;
    let then = match control.slot_confirmed(&own.slot).await? {
        None => {
            let failover = server.failover_slots();
            let (lsn, snapshot) = within(
                conn.create_slot_exporting(&own.slot, failover),
                &info.shown,
            )
                .await
                .map_err(|e| {
                    e.remedy("the user needs the REPLICATION attribute (ALTER ROLE … REPLICATION) and a free slot (max_replication_slots)")
                })?;
            tracing::info!(slot = %own.slot, lsn = %super::lsn_to_string(lsn), "created the replication slot with an exported snapshot");
            open_read(&control, Some(&snapshot)).await?;
            lsn
        }
        Some(lsn) => {
            tracing::warn!(
                slot = %own.slot,
                lsn = %super::lsn_to_string(lsn),
                "the replication slot exists already, so the snapshot reads the tables as they are now: rows committed since the slot's position arrive twice (same id)"
            );
            open_read(&control, None).await?;
            lsn
        }
    };
    // The exported snapshot is imported: the replication connection may go.
    drop(conn);
    Ok(Begun {
        reader: TableReader::Postgres(Reader {
            control,
            generated,
            plans: HashMap::new(),
        }),
        identity: SourceIdentity {
            kind: SourceKind::Postgres,
            server_id: None,
            server_uuid: None,
            system_identifier: Some(system.id),
            slot: Some(own.slot.clone()),
            // A standby's timeline can change under a session (a promotion): a primary's only.
            timeline: (!server.standby).then_some(system.timeline),
        },
        then: position(then),
    })
}

/// Starts the read-only `REPEATABLE READ` transaction the snapshot reads in (importing `snapshot`).
async fn open_read(control: &Control, snapshot: Option<&str>) -> Result<()> {
    let mut sql = String::from("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY;");
    if let Some(name) = snapshot {
        sql.push_str(&format!(
            "SET TRANSACTION SNAPSHOT '{}';",
            name.replace('\'', "''")
        ));
    }
    control
        .client()
        .batch_execute(&sql)
        .await
        .map_err(|e| control.failed("starting the snapshot transaction", e))
}

impl Reader {
    /// Up to `limit` rows of `table` after key `after` (matching `predicate`), in key order.
    pub async fn chunk(
        &mut self,
        table: &str,
        after: Option<&[KeyValue]>,
        predicate: Option<&str>,
        limit: usize,
    ) -> Result<Vec<KeyedRow>> {
        let plan_key = (table.to_string(), predicate.map(str::to_string), limit);
        if !self.plans.contains_key(&plan_key) {
            let plan = self.plan(table, predicate, limit).await?;
            self.plans.insert(plan_key.clone(), plan);
        }
        let plan = &self.plans[&plan_key];
        check_key_width(table, after, plan.keys)?;
        let texts: Vec<String> = after
            .unwrap_or_default()
            .iter()
            .map(|k| String::from_utf8_lossy(&k.to_bytes()).into_owned())
            .collect();
        let params: Vec<&(dyn ToSql + Sync)> =
            texts.iter().map(|t| t as &(dyn ToSql + Sync)).collect();
        let statement = if after.is_some() {
            &plan.next
        } else {
            &plan.first
        };
        let result = self
            .control
            .client()
            .query(statement, &params)
            .await
            .map_err(|e| self.read_error(e, table, predicate))?;
        let mut rows = Vec::with_capacity(result.len());
        for row in result {
            let mut key = Vec::with_capacity(plan.keys);
            for i in 0..plan.keys {
                let text: Option<String> = row.get(i);
                key.push(KeyValue::Text(text.ok_or_else(|| {
                    Error::source(format!("a primary key column of {table} is NULL"))
                })?));
            }
            let values = plan
                .types
                .iter()
                .enumerate()
                .map(|(i, ty)| match row.get::<_, Option<&str>>(plan.keys + i) {
                    Some(text) => super::values::from_text(*ty, text.as_bytes()),
                    None => Value::Null,
                })
                .collect();
            rows.push(KeyedRow::new(&plan.table, &plan.names, values, key));
        }
        Ok(rows)
    }

    /// The table's columns (those pgoutput sends: not dropped, not generated unless stored and
    /// published, see [`super::published`]) and primary key, and the two statements that read it.
    async fn plan(&mut self, table: &str, predicate: Option<&str>, limit: usize) -> Result<Plan> {
        let client = self.control.client();
        let quoted = quote_table(table);
        let columns = client
            .query(
                "SELECT a.attname::text, a.atttypid::oid FROM pg_attribute a \
                 WHERE a.attrelid = $1::text::regclass AND a.attnum > 0 AND NOT a.attisdropped \
                 AND (a.attgenerated = '' OR ($2 AND a.attgenerated = 's')) ORDER BY a.attnum",
                &[&quoted, &self.generated],
            )
            .await
            .map_err(|e| {
                self.control
                    .failed("reading the outbox table's columns", e)
                    .remedy("check that the table in source.tables exists and the outboxd user may SELECT it")
            })?;
        let keys = client
            .query(
                "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) FROM pg_index i \
                 CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) \
                 JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
                 WHERE i.indrelid = $1::text::regclass AND i.indisprimary ORDER BY k.ord",
                &[&quoted],
            )
            .await
            .map_err(|e| {
                self.control
                    .failed("reading the outbox table's primary key", e)
            })?;
        if keys.is_empty() {
            return Err(Error::config(format!(
                "outbox table {table} has no primary key, and a snapshot reads in key order"
            ))
            .remedy("add a primary key to the table, or set source.snapshot = \"never\""));
        }
        let key_names: Vec<String> = keys.iter().map(|r| quote_ident(r.get(0))).collect();
        let key_types: Vec<String> = keys.iter().map(|r| r.get(1)).collect();
        // Keys as text (cast back to their type to compare); values in their type's own output
        // form, which is what pgoutput sends (`format('%s', …)` calls the output function, where a
        // cast to text would write `true` for `t` and drop a char(n)'s padding).
        let selected: Vec<String> = key_names
            .iter()
            .map(|c| format!("{c}::text"))
            .chain(columns.iter().map(|r| {
                let c = quote_ident(r.get(0));
                format!("CASE WHEN {c} IS NULL THEN NULL ELSE format('%s', {c}) END")
            }))
            .collect();
        let order = key_names.join(", ");
        let params: Vec<String> = key_types
            .iter()
            .enumerate()
            .map(|(i, ty)| format!("${}::text::{ty}", i + 1))
            .collect();
        let filter = predicate.map(|p| format!("({p})"));
        let first_where = filter
            .clone()
            .map(|f| format!(" WHERE {f}"))
            .unwrap_or_default();
        let after = format!("({order}) > ({})", params.join(", "));
        let next_where = match &filter {
            Some(f) => format!(" WHERE {after} AND {f}"),
            None => format!(" WHERE {after}"),
        };
        let select = |filter: &str| {
            format!(
                "SELECT {} FROM {quoted}{filter} ORDER BY {order} LIMIT {limit}",
                selected.join(", ")
            )
        };
        let first = client
            .prepare(&select(&first_where))
            .await
            .map_err(|e| self.read_error(e, table, predicate))?;
        let next = client
            .prepare(&select(&next_where))
            .await
            .map_err(|e| self.read_error(e, table, predicate))?;
        Ok(Plan {
            table: Arc::from(table),
            names: columns
                .iter()
                .map(|r| Arc::from(r.get::<_, &str>(0)))
                .collect(),
            types: columns.iter().map(|r| r.get::<_, u32>(1)).collect(),
            keys: keys.len(),
            first,
            next,
        })
    }

    /// A failed read: a predicate the server refused is named as such.
    fn read_error(&self, e: tokio_postgres::Error, table: &str, predicate: Option<&str>) -> Error {
        let code = e.code().map(|c| c.code().to_string());
        match (code.as_deref(), predicate) {
            // syntax_error, undefined_column, undefined_function, datatype_mismatch
            (Some("42601" | "42703" | "42883" | "42804"), Some(p)) => {
                let error = self.control.failed("reading a snapshot chunk", e);
                Error::config(format!(
                    "the snapshot cannot read {table} with snapshot_where = {p:?}: {}",
                    error.message()
                ))
                .remedy("fix source.snapshot_where (or the --where of `outboxd snapshot`): an SQL condition on the outbox table's columns, e.g. \"published = false\"")
            }
            _ => self.control.failed("reading a snapshot chunk", e),
        }
    }

    pub async fn close(self) {
        let _ = self.control.client().batch_execute("COMMIT").await;
    }
}
