//! Deleting forwarded rows from MySQL/MariaDB outbox tables (see `crate::retention` for the policy).
//!
//! A sample reads, in this order, the time before which every inserting transaction has ended and
//! then the binlog end. The time is the older of `NOW() - older_than` and the start of the oldest
//! open InnoDB transaction (`information_schema.innodb_trx`), less [`MARGIN_SECONDS`]; a row whose
//! `created_at` (filled by the server as the transaction runs) is older began before every
//! transaction still open, so it had ended before the binlog end was read. Once the checkpoint
//! covers that end, such rows have been acknowledged. The margin covers `trx_started`'s whole
//! seconds and the moment between a statement's start (its `NOW()`) and its transaction's entry in
//! `innodb_trx`.
//!
//! Deletes are `DELETE … WHERE created_at < ? LIMIT batch`, each its own autocommit statement, so
//! no lock is held longer than one batch. Partitions are dropped when their upper bound is at or
//! before the same time (RANGE and RANGE COLUMNS on the column, or on a function of it that grows
//! with it: `UNIX_TIMESTAMP`, `TO_DAYS`, `TO_SECONDS`, `YEAR`).

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Value as MyValue};

use super::connect::{map_err, open};
use super::snapshot::{quote_ident, quote_table};
use super::{current_end, ServerInfo};
use crate::error::{Error, Result};
use crate::preflight::Item;
use crate::source::config::SourceConfig;
use crate::source::prune::{fail_item, Ahead, NewPartition};
use crate::source::{Position, SourceIdentity};

/// Seconds taken off the oldest open transaction's start (see the module docs).
const MARGIN_SECONDS: u32 = 5;
/// How long a DROP PARTITION waits for the table's metadata lock before trying next time.
const LOCK_WAIT_SECONDS: u32 = 5;

const ER_SPECIFIC_ACCESS_DENIED: u16 = 1227;
const ER_TABLEACCESS_DENIED: u16 = 1142;
const ER_OPTION_PREVENTS_STATEMENT: u16 = 1290;
const ER_BAD_FIELD: u16 = 1054;
const ER_SAME_NAME_PARTITION: u16 = 1517;
const ER_RANGE_NOT_INCREASING: u16 = 1493;
const ER_DROP_PARTITION_NON_EXISTENT: u16 = 1507;
const ER_PARTITION_MGMT_ON_NONPARTITIONED: u16 = 1505;
/// The partition `check` asks the server to drop, to learn whether ALTER and DROP are granted
/// (refused for privileges first, then for the name): never one that exists.
const PROBE_PARTITION: &str = "outboxd_check_no_such_partition";
/// Lock wait timeout, deadlock, query interrupted, MariaDB's statement time limit: next round.
const RETRY_NEXT_ROUND: [u16; 4] = [1205, 1213, 1317, 1969];

pub struct Pruner {
    conn: Conn,
    config: SourceConfig,
    /// Whether the server is MariaDB, once a sample read it (the grants differ).
    mariadb: Option<bool>,
}

/// What a sample found: the binlog end, and the time before which rows may go once the checkpoint
/// covers that end.
pub struct Sample {
    pub log_end: Position,
    cutoff: MyValue,
    pub shown: String,
    /// The server sampled, to compare with the one the checkpoint was written against.
    pub identity: SourceIdentity,
}

impl Pruner {
    pub async fn connect(config: &SourceConfig) -> Result<Pruner> {
        let mut conn = open(config).await?;
        // READ COMMITTED: a DELETE scanning for old rows locks only the rows it deletes, not
        // every row and gap it passes (which would block the application's inserts).
        conn.query_drop("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .await
            .map_err(|e| map_err(e, config))?;
        // The server's kind names the grants in a remedy (before the first sample reads it).
        let version: Option<String> = conn
            .query_first("SELECT VERSION()")
            .await
            .map_err(|e| map_err(e, config))?;
        Ok(Pruner {
            conn,
            config: config.clone(),
            mariadb: version.map(|v| v.contains("MariaDB")),
        })
    }

    /// Every grant the prune user needs, for this server's kind (MariaDB reads the binlog end with
    /// `BINLOG MONITOR`, MySQL with `REPLICATION CLIENT`).
    fn grants(&self) -> String {
        let log_end = match self.mariadb {
            Some(true) => "BINLOG MONITOR",
            Some(false) => "REPLICATION CLIENT",
            None => "BINLOG MONITOR (MariaDB 10.5+; MySQL: REPLICATION CLIENT)",
        };
        format!(
            "GRANT PROCESS, {log_end} ON *.* (the open transactions and the binlog end), and SELECT, DELETE (and DROP, ALTER for drop_partitions and partitions_ahead) ON the outbox tables, to the user in prune.url (or source.url); the next round uses them, no restart needed"
        )
    }

    fn failed(&self, what: &str, e: mysql_async::Error) -> Error {
        match &e {
            mysql_async::Error::Server(se)
                if [ER_SPECIFIC_ACCESS_DENIED, ER_TABLEACCESS_DENIED].contains(&se.code) =>
            {
                Error::source(format!("prune: {what}: {}", se.message))
                    .remedy(self.grants())
                    .caused_by(e)
            }
            mysql_async::Error::Server(se) if se.code == ER_OPTION_PREVENTS_STATEMENT => {
                Error::source(format!("prune: {what}: {}", se.message))
                    .remedy("the server is read-only (a replica?): set prune.url to the primary")
                    .caused_by(e)
            }
            mysql_async::Error::Server(se) if RETRY_NEXT_ROUND.contains(&se.code) => {
                Error::source(format!("prune: {what}: {}", se.message))
                    .remedy("a transaction held the rows or the table; outboxd tries again next round")
                    .transient()
                    .caused_by(e)
            }
            mysql_async::Error::Server(se) if se.code == ER_BAD_FIELD => {
                Error::config(format!("prune: {what}: {}", se.message))
                    .remedy("set prune.column to the outbox table's creation-time column (filled by the server: DEFAULT CURRENT_TIMESTAMP)")
                    .caused_by(e)
            }
            _ => {
                let inner = map_err(e, &self.config);
                let text = format!("prune: {what}: {}", inner.message());
                let mut out = Error::source(text);
                if let Some(r) = inner.remedy_text() {
                    out = out.remedy(r.to_string());
                }
                if inner.is_transient() {
                    out = out.transient();
                }
                out
            }
        }
    }

    /// Samples the cutoff time, then the binlog end (in that order; see the module docs).
    pub async fn sample(&mut self, older_than_secs: u64) -> Result<Sample> {
        let query = format!(
            "SELECT LEAST(NOW(6) - INTERVAL {older_than_secs} SECOND, \
             COALESCE((SELECT MIN(trx_started) FROM information_schema.innodb_trx), NOW(6)) \
             - INTERVAL {MARGIN_SECONDS} SECOND)"
        );
        let cutoff: Option<MyValue> = self
            .conn
            .query_first(query)
            .await
            .map_err(|e| self.failed("reading the open transactions", e))?;
        let cutoff = cutoff.unwrap_or(MyValue::NULL);
        let shown = match &cutoff {
            MyValue::Date(y, mo, d, h, mi, s, _) => {
                format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}")
            }
            other => format!("{other:?}"),
        };
        let info = ServerInfo::read(&mut self.conn)
            .await
            .map_err(|e| self.failed("reading the server's settings", e))?;
        self.mariadb = Some(info.is_mariadb);
        let end = current_end(&mut self.conn, &info)
            .await
            .map_err(|e| self.failed("reading the binlog end", e))?;
        Ok(Sample {
            log_end: end.to_position(),
            cutoff,
            shown,
            identity: info.identity(),
        })
    }

    /// Deletes up to `batch` rows of `table` older than the sample's cutoff; returns how many.
    pub async fn delete_batch(
        &mut self,
        table: &str,
        column: &str,
        sample: &Sample,
        batch: u64,
    ) -> Result<u64> {
        let statement = format!(
            "DELETE FROM {} WHERE {} < ? LIMIT {batch}",
            quote_table(table),
            quote_ident(column)
        );
        self.conn
            .exec_drop(statement, (sample.cutoff.clone(),))
            .await
            .map_err(|e| self.failed(&format!("deleting from {table}"), e))?;
        Ok(self.conn.affected_rows())
    }

    /// Drops the partitions of `table` whose upper bound is at or before the sample's cutoff, oldest
    /// first; returns their names.
    pub async fn drop_partitions(
        &mut self,
        table: &str,
        column: &str,
        sample: &Sample,
    ) -> Result<Vec<String>> {
        let rows = self.partitions(table).await?;
        let mut dropped = Vec::new();
        // Never the last partition: MySQL refuses to drop them all, and new rows need a home.
        for (partition, method, expression, bound) in &rows[..rows.len() - 1] {
            let at_cutoff = bound_expression(table, column, method, expression)?;
            if bound.eq_ignore_ascii_case("MAXVALUE") || bound.is_empty() {
                break;
            }
            // The bound is the server's own rendering of a constant (a number or a quoted literal).
            let behind: Option<i64> = self
                .conn
                .exec_first(
                    format!("SELECT ({at_cutoff}) >= ({bound})"),
                    (sample.cutoff.clone(),),
                )
                .await
                .map_err(|e| self.failed(&format!("comparing partition {partition}"), e))?;
            if behind != Some(1) {
                break;
            }
            self.conn
                .query_drop(format!(
                    "SET SESSION lock_wait_timeout = {LOCK_WAIT_SECONDS}"
                ))
                .await
                .map_err(|e| self.failed("setting lock_wait_timeout", e))?;
            self.conn
                .query_drop(format!(
                    "ALTER TABLE {} DROP PARTITION {}",
                    quote_table(table),
                    quote_ident(partition)
                ))
                .await
                .map_err(|e| self.failed(&format!("dropping partition {partition}"), e))?;
            dropped.push(partition.clone());
        }
        Ok(dropped)
    }

    /// `table`'s partitions in order: (name, method, expression, upper bound as the server shows
    /// it); an error when it has none.
    async fn partitions(&mut self, table: &str) -> Result<Vec<(String, String, String, String)>> {
        let (schema, name) = table.split_once('.').unwrap_or(("", table));
        let rows: Vec<(String, String, String, String)> = self
            .conn
            .exec(
                "SELECT PARTITION_NAME, PARTITION_METHOD, COALESCE(PARTITION_EXPRESSION, ''), \
                 COALESCE(PARTITION_DESCRIPTION, '') FROM information_schema.PARTITIONS \
                 WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? AND PARTITION_NAME IS NOT NULL \
                 ORDER BY PARTITION_ORDINAL_POSITION",
                (schema, name),
            )
            .await
            .map_err(|e| self.failed(&format!("reading the partitions of {table}"), e))?;
        if rows.is_empty() {
            return Err(not_partitioned(table));
        }
        Ok(rows)
    }

    /// Adds the partitions `plan` asks for after `table`'s last finite bound, in one statement:
    /// `ADD PARTITION`, or, when the last partition is `MAXVALUE`, `REORGANIZE PARTITION` of it
    /// into the new ones and itself (rows already past the last bound move with it). Returns the
    /// new names.
    pub async fn create_partitions(
        &mut self,
        table: &str,
        column: &str,
        plan: &Ahead,
    ) -> Result<Vec<String>> {
        let rows = self.partitions(table).await?;
        let (_, method, expression, _) = &rows[0];
        let function = key_function(table, column, method, expression)?;
        let is_max = |bound: &str| bound.eq_ignore_ascii_case("MAXVALUE");
        let catch_all = rows.last().filter(|r| is_max(&r.3)).map(|r| r.0.clone());
        let finite = rows
            .iter()
            .rev()
            .map(|r| &r.3)
            .find(|b| !is_max(b) && !b.is_empty());
        let Some(bound) = finite else {
            if catch_all.is_none() {
                return Err(Error::config(format!(
                    "prune.partitions_ahead: {table} has no partition with an upper bound to continue from"
                ))
                .remedy("create the first partition by hand (VALUES LESS THAN a date), then outboxd keeps them ahead"));
            }
            // Only the MAXVALUE partition: the first new one takes everything up to its bound.
            let now: Option<i64> = self
                .conn
                .query_first(if function.as_deref() == Some("unix_timestamp") {
                    "SELECT UNIX_TIMESTAMP()"
                } else {
                    "SELECT TIMESTAMPDIFF(SECOND, '1970-01-01 00:00:00', NOW())"
                })
                .await
                .map_err(|e| self.failed("reading the time", e))?;
            let now = now.unwrap_or_default();
            return self
                .add_partitions(table, function, catch_all, plan.plan(i64::MIN / 4, now))
                .await;
        };
        // The bound is the server's own rendering of a constant: a number or a quoted date.
        let plain = |c: char| c.is_ascii_digit() || " :.-'".contains(c);
        if !bound.chars().all(plain) {
            return Err(Error::config(format!(
                "prune.partitions_ahead: the last bound of {table} ({bound}) is not a date or a number"
            ))
            .remedy("partition on the creation time (a DATETIME, TIMESTAMP or DATE column)"));
        }
        let as_time = match function.as_deref() {
            None => format!("CAST({bound} AS DATETIME)"),
            // Planned on the epoch seconds themselves: no session time zone in between.
            Some("unix_timestamp") => format!("'1970-01-01 00:00:00' + INTERVAL {bound} SECOND"),
            Some("to_days") => format!("FROM_DAYS({bound})"),
            Some("to_seconds") => {
                format!("FROM_DAYS({bound} DIV 86400) + INTERVAL ({bound} MOD 86400) SECOND")
            }
            Some(_) => format!("MAKEDATE({bound}, 1)"),
        };
        let seconds = |t: &str| format!("TIMESTAMPDIFF(SECOND, '1970-01-01 00:00:00', {t})");
        let times: Option<(Option<i64>, i64)> = self
            .conn
            .query_first(format!(
                "SELECT {}, {}",
                seconds(&as_time),
                if function.as_deref() == Some("unix_timestamp") {
                    "UNIX_TIMESTAMP()".to_string()
                } else {
                    seconds("NOW()")
                }
            ))
            .await
            .map_err(|e| self.failed(&format!("reading the last bound of {table}"), e))?;
        let Some((Some(last), now)) = times else {
            return Err(Error::source(format!(
                "prune.partitions_ahead: the last bound of {table} ({bound}) is not a time"
            )));
        };
        self.add_partitions(table, function, catch_all, plan.plan(last, now))
            .await
    }

    /// Adds `new` to `table` (partitioned by `function` of the column, or by the column), before
    /// `catch_all` (the MAXVALUE partition) when there is one, in one statement.
    async fn add_partitions(
        &mut self,
        table: &str,
        function: Option<String>,
        catch_all: Option<String>,
        new: Vec<NewPartition>,
    ) -> Result<Vec<String>> {
        if new.is_empty() {
            return Ok(Vec::new());
        }
        let definitions: Vec<String> = new
            .iter()
            .map(|p| {
                let at = match function.as_deref() {
                    None => format!("'{}'", p.literal),
                    Some("unix_timestamp") => p.upper.to_string(),
                    Some(f) => format!("{f}('{}')", p.literal),
                };
                format!(
                    "PARTITION {} VALUES LESS THAN ({at})",
                    quote_ident(&p.suffix)
                )
            })
            .collect();
        if let Some(max) = &catch_all {
            // REORGANIZE copies the partition's rows while inserts wait: only an empty one.
            let occupied: Option<i64> = self
                .conn
                .query_first(format!(
                    "SELECT 1 FROM {} PARTITION ({}) LIMIT 1",
                    quote_table(table),
                    quote_ident(max)
                ))
                .await
                .map_err(|e| self.failed(&format!("looking into partition {max}"), e))?;
            if occupied.is_some() {
                return Err(Error::config(format!(
                    "prune.partitions_ahead: the MAXVALUE partition {max} of {table} holds rows, and splitting it would copy them while inserts wait"
                ))
                .remedy(format!("split it once by hand at a quiet time (ALTER TABLE {table} REORGANIZE PARTITION {max} INTO (PARTITION p… VALUES LESS THAN (…), PARTITION {max} VALUES LESS THAN (MAXVALUE))) so that it is empty; from then on outboxd keeps it empty")));
            }
        }
        let statement = match &catch_all {
            Some(max) => format!(
                "ALTER TABLE {} REORGANIZE PARTITION {q} INTO ({}, PARTITION {q} VALUES LESS THAN {})",
                quote_table(table),
                definitions.join(", "),
                if function.is_none() { "(MAXVALUE)" } else { "MAXVALUE" },
                q = quote_ident(max),
            ),
            None => format!(
                "ALTER TABLE {} ADD PARTITION ({})",
                quote_table(table),
                definitions.join(", ")
            ),
        };
        self.conn
            .query_drop(format!(
                "SET SESSION lock_wait_timeout = {LOCK_WAIT_SECONDS}"
            ))
            .await
            .map_err(|e| self.failed("setting lock_wait_timeout", e))?;
        if let Err(e) = self.conn.query_drop(&statement).await {
            let what = format!("adding partitions to {table}");
            return Err(match &e {
                mysql_async::Error::Server(se) if se.code == ER_SAME_NAME_PARTITION => {
                    Error::config(format!("prune: {what}: {}", se.message))
                        .remedy("a partition already has the name outboxd gives the new one (p + its first day): rename it, or create the partitions by hand")
                        .caused_by(e)
                }
                mysql_async::Error::Server(se) if se.code == ER_RANGE_NOT_INCREASING => {
                    Error::config(format!("prune: {what}: {}", se.message))
                        .remedy("prune.partition_every must move the partition function's value each step (a year for YEAR())")
                        .caused_by(e)
                }
                _ => self.failed(&what, e),
            });
        }
        Ok(new.into_iter().map(|p| p.suffix).collect())
    }

    /// What `check` reports for pruning `tables`: the sample (PROCESS, the binlog), the column,
    /// and the privileges the mode needs, each tried on the server without changing anything
    /// (`DELETE … WHERE 1 = 0`; `ALTER TABLE … DROP PARTITION` of a name that does not exist, which
    /// the server refuses for privileges before it looks for the partition).
    pub async fn preflight(
        &mut self,
        tables: &[String],
        column: &str,
        deletes: bool,
        partitions: bool,
        drops: bool,
    ) -> Vec<Item> {
        let mut items = Vec::new();
        // A probe behind a metadata lock gives up after this, not after the step's minute.
        let _ = self
            .conn
            .query_drop(format!(
                "SET SESSION lock_wait_timeout = {LOCK_WAIT_SECONDS}"
            ))
            .await;
        match self.sample(0).await {
            Ok(_) => items.push(Item::pass(
                "prune",
                "sees the open transactions and the binlog end",
            )),
            Err(e) => items.push(fail_item(&e)),
        }
        for table in tables {
            let t = quote_table(table);
            let mut found = Vec::new();
            let mut failed = false;
            let mut probe = |result: std::result::Result<(), Error>, ok: &str| match result {
                Ok(()) => found.push(ok.to_string()),
                Err(e) => {
                    failed = true;
                    items.push(fail_item(&e))
                }
            };
            let r = self
                .conn
                .query_drop(format!("SELECT {} FROM {t} LIMIT 0", quote_ident(column)))
                .await
                .map_err(|e| self.failed(&format!("reading {table}.{column}"), e));
            probe(r, &format!("column {column}"));
            if deletes {
                let r = self
                    .conn
                    .query_drop(format!("DELETE FROM {t} WHERE 1 = 0"))
                    .await
                    .map_err(|e| self.failed(&format!("deleting from {table}"), e));
                probe(r, "DELETE");
            }
            if partitions {
                let layout = match self.partitions(table).await {
                    Ok(rows) => {
                        let (_, method, expression, _) = &rows[0];
                        key_function(table, column, method, expression)
                            .map(|_| format!("partitioned BY {method} ({expression})"))
                    }
                    Err(e) => Err(e),
                };
                match layout {
                    Ok(shown) => found.push(shown),
                    Err(e) => {
                        failed = true;
                        items.push(fail_item(&e));
                    }
                }
            }
            if drops {
                // Never a partition that exists: the probe must fail.
                let taken = matches!(self.partitions(table).await,
                    Ok(rows) if rows.iter().any(|r| r.0 == PROBE_PARTITION));
                let r = if taken {
                    Ok(())
                } else {
                    self.conn
                        .query_drop(format!(
                            "ALTER TABLE {t} DROP PARTITION {}",
                            quote_ident(PROBE_PARTITION)
                        ))
                        .await
                };
                match r {
                    Err(mysql_async::Error::Server(se))
                        if se.code == ER_DROP_PARTITION_NON_EXISTENT
                            || se.code == ER_PARTITION_MGMT_ON_NONPARTITIONED =>
                    {
                        found.push("ALTER, DROP".into())
                    }
                    Err(e) => {
                        failed = true;
                        items.push(fail_item(&self.failed(&format!("altering {table}"), e)));
                    }
                    Ok(()) => found.push("ALTER, DROP".into()),
                }
            }
            if !failed {
                items.push(Item::pass(
                    "prune",
                    format!("{table}: {}", found.join(", ")),
                ));
            }
        }
        items
    }

    /// The server's estimate of the rows in `tables` (`information_schema.TABLES.TABLE_ROWS`).
    pub async fn estimate_rows(&mut self, tables: &[String]) -> Result<u64> {
        let mut total = 0u64;
        for table in tables {
            let (schema, name) = table.split_once('.').unwrap_or(("", table));
            let rows: Option<Option<u64>> = self
                .conn
                .exec_first(
                    "SELECT TABLE_ROWS FROM information_schema.TABLES WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ?",
                    (schema, name),
                )
                .await
                .map_err(|e| self.failed("estimating the outbox rows", e))?;
            total += rows.flatten().unwrap_or(0);
        }
        Ok(total)
    }

    pub async fn close(self) {
        let _ = self.conn.disconnect().await;
    }
}

fn not_partitioned(table: &str) -> Error {
    Error::config(format!(
        "prune (drop_partitions, partitions_ahead): {table} has no partitions"
    ))
    .remedy("partition the table BY RANGE on its creation time, or use prune.mode = \"delete\"")
}

/// The partition expression with the column replaced by a parameter, for comparing with a bound.
fn bound_expression(table: &str, column: &str, method: &str, expression: &str) -> Result<String> {
    Ok(match key_function(table, column, method, expression)? {
        Some(f) => format!("{f}(?)"),
        None => "?".to_string(),
    })
}

/// How `table` is partitioned on `column`: None for RANGE COLUMNS(column), the function's name for
/// RANGE on a function of it that grows with it; an error for anything else.
fn key_function(
    table: &str,
    column: &str,
    method: &str,
    expression: &str,
) -> Result<Option<String>> {
    let unquoted = expression.replace('`', "");
    let function = unquoted
        .strip_suffix(&format!("({column})"))
        .map(|f| f.trim().to_ascii_lowercase());
    let ok = match method {
        "RANGE COLUMNS" => unquoted == column,
        "RANGE" => matches!(
            function.as_deref(),
            Some("unix_timestamp" | "to_days" | "to_seconds" | "year")
        ),
        _ => false,
    };
    if !ok {
        return Err(Error::config(format!(
            "prune.mode = \"drop_partitions\": {table} is partitioned BY {method} ({expression}), which outboxd cannot compare with prune.column {column:?}"
        ))
        .remedy("partition BY RANGE COLUMNS(column), or BY RANGE on UNIX_TIMESTAMP, TO_DAYS, TO_SECONDS or YEAR of it; or use prune.mode = \"delete\""));
    }
    Ok(function.filter(|_| method == "RANGE"))
}

#[cfg(test)]
mod tests {
    use super::bound_expression;

    #[test]
    fn partition_expressions_outboxd_can_compare_are_told_apart() {
        let ok = |m, e| bound_expression("app.outbox", "created_at", m, e);
        assert_eq!(ok("RANGE COLUMNS", "`created_at`").unwrap(), "?");
        assert_eq!(
            ok("RANGE", "unix_timestamp(`created_at`)").unwrap(),
            "unix_timestamp(?)"
        );
        assert_eq!(ok("RANGE", "to_days(`created_at`)").unwrap(), "to_days(?)");
        let refused = ok("RANGE", "`id` DIV 1000").unwrap_err();
        assert!(refused.message().contains("cannot compare"), "{refused}");
        assert!(ok("HASH", "`created_at`").is_err());
        assert!(ok("RANGE COLUMNS", "`id`").is_err());
    }
}
