//! Reading MySQL/MariaDB outbox tables for a snapshot (see [`crate::source::snapshot`]).
//!
//! One connection holds a `REPEATABLE READ` transaction started `WITH CONSISTENT SNAPSHOT` for the
//! whole read, so every chunk sees the tables as of one instant. That instant is paired with the
//! binlog position streaming starts at:
//! - MariaDB names it itself: `Binlog_snapshot_file`/`Binlog_snapshot_position` are the binlog
//!   position of the consistent snapshot, with no lock taken.
//! - MySQL has no such status, so a second connection takes `LOCK TABLES … READ` on the outbox
//!   tables (which waits until no transaction that wrote to them is still committing, and keeps new
//!   ones out), the snapshot starts, the binlog end is read, and the lock is released: a few
//!   milliseconds in which outbox writers wait (while the lock is wanted, new writers queue behind
//!   it: outboxd waits at most `lock_wait_timeout` = 5 s for it, then retries later).
//!
//! Chunks are `SELECT … WHERE (pk) > (last key) ORDER BY pk LIMIT n` over the primary key (binary
//! protocol, so keys keep their types), values converted by [`super::columns::convert_selected`]
//! exactly as the binlog decoder converts them; the session runs in UTC so `TIMESTAMP`s match too.

use std::collections::HashMap;
use std::sync::Arc;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Value as MyValue};

use super::connect::{map_err, open};
use super::{as_refusal, current_end, require_serves, BinlogPosition, MariaGtidState, ServerInfo};
use crate::error::{Error, Result};
use crate::source::config::SourceConfig;
use crate::source::snapshot::{check_key_width, Begun, KeyValue, KeyedRow, TableReader};

/// Longest wait for the outbox tables' read lock (MySQL only); writers queue behind it meanwhile.
const LOCK_WAIT_SECONDS: u32 = 5;

/// A table as the snapshot reads it.
struct Plan {
    table: Arc<str>,
    names: Arc<[Arc<str>]>,
    keys: usize,
    first: String,
    next: String,
}

pub struct Reader {
    conn: Conn,
    config: SourceConfig,
    plans: HashMap<(String, Option<String>), Plan>,
}

/// Opens the snapshot transaction; with `exact`, paired with the binlog position streaming starts
/// at (see the module docs), otherwise `then` is just the current end.
pub async fn begin(config: &SourceConfig, exact: bool) -> Result<Begun> {
    // Refused as a stream would be: its start position comes from this host.
    begin_here(config, exact).await.map_err(as_refusal)
}

async fn begin_here(config: &SourceConfig, exact: bool) -> Result<Begun> {
    let mut conn = open(config).await?;
    let err = |e| map_err(e, config);
    let server = ServerInfo::read(&mut conn).await.map_err(err)?;
    require_serves(&mut conn, &server, config).await?;
    conn.query_drop("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .await
        .map_err(err)?;
    conn.query_drop("SET SESSION time_zone = '+00:00'")
        .await
        .map_err(err)?;
    let lock_path =
        exact && (!server.is_mariadb || std::env::var_os("OUTBOXD_TEST_SNAPSHOT_LOCK").is_some());
    let then = if lock_path {
        let mut lock = open(config).await?;
        let tables: Vec<String> = config
            .tables
            .iter()
            .map(|t| format!("{} READ", quote_table(t)))
            .collect();
        let locked = async {
            // A connection lost while holding the lock must not keep it for hours.
            lock.query_drop(format!(
                "SET SESSION lock_wait_timeout = {LOCK_WAIT_SECONDS}, wait_timeout = 60"
            ))
            .await?;
            lock.query_drop(format!("LOCK TABLES {}", tables.join(", ")))
                .await?;
            conn.query_drop("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")
                .await?;
            let end = current_end(&mut lock, &server).await;
            lock.query_drop("UNLOCK TABLES").await?;
            end
        };
        let then = locked.await.map_err(|e| {
            map_err(e, config).remedy(
                "the snapshot pairs its read with the binlog position under a brief LOCK TABLES … READ on the outbox tables: GRANT LOCK TABLES (and SELECT) on them to the outboxd user, and make sure no long transaction holds them",
            )
        })?;
        let _ = lock.disconnect().await;
        then
    } else {
        conn.query_drop("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")
            .await
            .map_err(err)?;
        if exact {
            mariadb_snapshot_position(&mut conn)
                .await
                .map_err(err)?
                .ok_or_else(|| {
                    Error::source("MariaDB did not report the binlog position of the consistent snapshot (Binlog_snapshot_file is empty)")
                        .remedy("enable the binary log (log-bin) on the server outboxd reads")
                })?
        } else {
            current_end(&mut conn, &server).await.map_err(err)?
        }
    };
    let identity = server.identity();
    Ok(Begun {
        reader: TableReader::Mysql(Reader {
            conn,
            config: config.clone(),
            plans: HashMap::new(),
        }),
        identity,
        then: then.to_position(),
    })
}

/// MariaDB's binlog position of the open consistent snapshot, with its GTID state.
async fn mariadb_snapshot_position(conn: &mut Conn) -> mysql_async::Result<Option<BinlogPosition>> {
    let rows: Vec<(String, String)> = conn.query("SHOW STATUS LIKE 'binlog_snapshot_%'").await?;
    let get = |name: &str| {
        rows.iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let (Some(file), Some(pos)) = (get("Binlog_snapshot_file"), get("Binlog_snapshot_position"))
    else {
        return Ok(None);
    };
    let Ok(pos) = pos.parse::<u64>() else {
        return Ok(None);
    };
    if file.is_empty() {
        return Ok(None);
    }
    let text: Option<String> = conn
        .exec_first("SELECT BINLOG_GTID_POS(?, ?)", (file.clone(), pos))
        .await?;
    let gtid = MariaGtidState::parse(&text.unwrap_or_default())
        .map_err(|e| mysql_async::Error::Other(e.message().to_string().into()))?;
    Ok(Some(BinlogPosition {
        file,
        pos,
        gtid: Some(gtid),
        mysql_gtids: None,
    }))
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
        let plan_key = (table.to_string(), predicate.map(str::to_string));
        if !self.plans.contains_key(&plan_key) {
            let plan = self.plan(table, predicate).await?;
            self.plans.insert(plan_key.clone(), plan);
        }
        let plan = &self.plans[&plan_key];
        let (sql, mut params) = match after {
            None => (&plan.first, Vec::new()),
            Some(key) => (&plan.next, key.iter().map(key_param).collect()),
        };
        check_key_width(table, after, plan.keys)?;
        params.push(MyValue::UInt(limit as u64));
        let result: Vec<mysql_async::Row> = self
            .conn
            .exec(sql.as_str(), params)
            .await
            .map_err(|e| read_error(e, &self.config, table, predicate))?;
        let mut rows = Vec::with_capacity(result.len());
        for row in result {
            let columns = row.columns();
            let values = row.unwrap();
            let mut values = values.into_iter();
            let key = values
                .by_ref()
                .take(plan.keys)
                .zip(columns.iter())
                .map(|(v, c)| key_value(v, c))
                .collect::<Result<Vec<_>>>()?;
            let values = values
                .zip(columns.iter().skip(plan.keys))
                .map(|(v, c)| super::columns::convert_selected(c, v))
                .collect();
            rows.push(KeyedRow::new(&plan.table, &plan.names, values, key));
        }
        Ok(rows)
    }

    /// The table's columns and primary key, and the two statements that read it.
    async fn plan(&mut self, table: &str, predicate: Option<&str>) -> Result<Plan> {
        let (schema, name) = table.split_once('.').unwrap_or(("", table));
        let config = &self.config;
        let described: Vec<(String, String, String)> = self
            .conn
            .exec(
                "SELECT COLUMN_NAME, DATA_TYPE, COLUMN_TYPE FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? ORDER BY ORDINAL_POSITION",
                (schema, name),
            )
            .await
            .map_err(|e| map_err(e, config))?;
        let columns: Vec<String> = described.iter().map(|(c, _, _)| c.clone()).collect();
        let type_of = |column: &str| {
            described
                .iter()
                .find(|(c, _, _)| c == column)
                .map(|(_, data, full)| (data.to_ascii_lowercase(), full.clone()))
                .unwrap_or_default()
        };
        if columns.is_empty() {
            return Err(Error::source(format!(
                "outbox table {table} does not exist (or the outboxd user cannot see it)"
            ))
            .remedy("fix source.tables, or GRANT SELECT on the table to the outboxd user"));
        }
        let keys: Vec<String> = self
            .conn
            .exec(
                "SELECT COLUMN_NAME FROM information_schema.KEY_COLUMN_USAGE WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? AND CONSTRAINT_NAME = 'PRIMARY' ORDER BY ORDINAL_POSITION",
                (schema, name),
            )
            .await
            .map_err(|e| map_err(e, config))?;
        if keys.is_empty() {
            return Err(Error::config(format!(
                "outbox table {table} has no primary key, and a snapshot reads in key order"
            ))
            .remedy("add a primary key to the table, or set source.snapshot = \"never\""));
        }
        let list = |cols: &[String]| {
            cols.iter()
                .map(|c| quote_ident(c))
                .collect::<Vec<_>>()
                .join(", ")
        };
        // The binlog carries an ENUM's index and a SET's bit mask, not their labels: read those.
        let values = columns
            .iter()
            .map(|c| match type_of(c).0.as_str() {
                "enum" | "set" => format!("{}+0", quote_ident(c)),
                _ => quote_ident(c),
            })
            .collect::<Vec<_>>()
            .join(", ");
        let selected = format!("{}, {values}", list(&keys));
        let order = list(&keys);
        // Each key is compared as its own type: a DECIMAL against a string would be compared as a
        // double (and skip keys that round alike); floating-point, ENUM and SET keys have no exact
        // order to resume by.
        let mut placeholders = Vec::with_capacity(keys.len());
        for key in &keys {
            let (data, full) = type_of(key);
            placeholders.push(match data.as_str() {
                "decimal" | "numeric" => format!("CAST(? AS {})", full.to_ascii_uppercase().replace(" UNSIGNED", "")),
                "float" | "double" | "real" | "enum" | "set" | "bit" => {
                    return Err(Error::config(format!(
                        "outbox table {table}'s primary key column {key} is {full}, which a snapshot cannot resume by exactly"
                    ))
                    .remedy("give the table an integer, character, binary or date-time primary key, or set source.snapshot = \"never\""))
                }
                _ => "?".to_string(),
            });
        }
        let placeholders = placeholders.join(", ");
        let filter = predicate.map(|p| format!("({p})"));
        let first_where = filter
            .clone()
            .map(|f| format!(" WHERE {f}"))
            .unwrap_or_default();
        let next_where = match &filter {
            Some(f) => format!(" WHERE ({order}) > ({placeholders}) AND {f}"),
            None => format!(" WHERE ({order}) > ({placeholders})"),
        };
        let from = quote_table(table);
        Ok(Plan {
            table: Arc::from(table),
            names: columns.iter().map(|c| Arc::from(c.as_str())).collect(),
            keys: keys.len(),
            first: format!("SELECT {selected} FROM {from}{first_where} ORDER BY {order} LIMIT ?"),
            next: format!("SELECT {selected} FROM {from}{next_where} ORDER BY {order} LIMIT ?"),
        })
    }

    pub async fn close(mut self) {
        let _ = self.conn.query_drop("COMMIT").await;
        let _ = self.conn.disconnect().await;
    }
}

/// A failed chunk read: a predicate the server refused is named as such.
fn read_error(
    e: mysql_async::Error,
    config: &SourceConfig,
    table: &str,
    predicate: Option<&str>,
) -> Error {
    const ER_PARSE_ERROR: u16 = 1064;
    const ER_BAD_FIELD_ERROR: u16 = 1054;
    const ER_TABLEACCESS_DENIED: u16 = 1142;
    match &e {
        mysql_async::Error::Server(se)
            if predicate.is_some() && [ER_PARSE_ERROR, ER_BAD_FIELD_ERROR].contains(&se.code) =>
        {
            Error::config(format!(
                "the snapshot cannot read {table} with snapshot_where = {:?}: {}",
                predicate.unwrap_or_default(),
                se.message
            ))
            .remedy("fix source.snapshot_where (or the --where of `outboxd snapshot`): an SQL condition on the outbox table's columns, e.g. \"published = false\"")
            .caused_by(e)
        }
        mysql_async::Error::Server(se) if se.code == ER_TABLEACCESS_DENIED => {
            Error::source(format!("the snapshot cannot read {table}: {}", se.message))
                .remedy("GRANT SELECT on the outbox tables to the outboxd user")
                .caused_by(e)
        }
        _ => map_err(e, config),
    }
}

fn key_value(value: MyValue, column: &mysql_async::Column) -> Result<KeyValue> {
    let binary = column.character_set() == 63;
    Ok(match value {
        MyValue::Int(i) => KeyValue::Int(i),
        MyValue::UInt(u) => KeyValue::UInt(u),
        MyValue::Bytes(b) if binary => KeyValue::bytes(&b),
        MyValue::Bytes(b) => match String::from_utf8(b) {
            Ok(s) => KeyValue::Text(s),
            Err(e) => KeyValue::bytes(e.as_bytes()),
        },
        MyValue::Date(y, mo, d, h, mi, s, us) => KeyValue::Text(format!(
            "{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}.{us:06}"
        )),
        MyValue::Time(neg, days, h, mi, s, us) => KeyValue::Text(format!(
            "{}{}:{mi:02}:{s:02}.{us:06}",
            if neg { "-" } else { "" },
            days as u64 * 24 + h as u64
        )),
        MyValue::Float(f) => KeyValue::Text(f.to_string()),
        MyValue::Double(f) => KeyValue::Text(f.to_string()),
        MyValue::NULL => {
            return Err(Error::source(format!(
                "primary key column {} is NULL",
                column.name_str()
            )))
        }
    })
}

fn key_param(key: &KeyValue) -> MyValue {
    match key {
        KeyValue::Int(i) => MyValue::Int(*i),
        KeyValue::UInt(u) => MyValue::UInt(*u),
        other => MyValue::Bytes(other.to_bytes()),
    }
}

pub(super) fn quote_ident(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
}

/// `schema.table` as a quoted name.
pub(super) fn quote_table(table: &str) -> String {
    match table.split_once('.') {
        Some((schema, name)) => format!("{}.{}", quote_ident(schema), quote_ident(name)),
        None => quote_ident(table),
    }
}
