//! Deleting forwarded rows from Postgres outbox tables (see `crate::retention` for the policy).
//!
//! A sample reads, in one statement, the oldest transaction still running (`xmin` of a fresh
//! snapshot) and the WAL end. Every transaction older than that `xmin` had ended, so its commit is
//! before the WAL end; once the checkpoint covers that end, its rows have been acknowledged. Rows
//! carry their inserting transaction in the `xmin` system column, so the test is exact and needs
//! no clock and no privilege beyond the table's: `age(xmin) > age(sample_xmin)` (both ages against
//! the same current transaction, so wraparound does not matter). A row frozen more than 2^31
//! transactions ago keeps its raw `xmin` and shows a negative age: it is old, and goes too. The WAL
//! end is the *insert* position, which covers commits written with `synchronous_commit = off`.
//! `older_than` is applied to the creation-time column on top.
//!
//! Deletes go through `(tableoid, ctid)` in batches (one statement each, its own transaction); the
//! outer `WHERE` repeats the conditions so a row changed meanwhile is judged again. A partition is
//! dropped when its upper bound is at or before `now() - older_than`, inside a transaction that
//! first locks it (waiting at most [`LOCK_TIMEOUT`]) and finds no row newer than the sample.

use super::control::{quote_ident, quote_table, split_table, ConnInfo, Control};
use super::lsn::parse_lsn;
use super::position;
use crate::error::{Error, Result};
use crate::source::config::SourceConfig;
use crate::source::Position;

/// How long dropping a partition waits for its lock (inserts into the table queue behind it).
const LOCK_TIMEOUT: &str = "2s";

pub struct Pruner {
    control: Control,
}

/// What a sample found: the WAL end, the oldest running transaction, and the retention time.
pub struct Sample {
    pub log_end: Position,
    xmin: u32,
    older_than_secs: u64,
    pub shown: String,
}

impl Pruner {
    pub async fn connect(config: &SourceConfig) -> Result<Pruner> {
        let info = ConnInfo::from_config(config)?;
        Ok(Pruner {
            control: Control::connect(&info).await?,
        })
    }

    fn failed(&self, what: &str, e: tokio_postgres::Error) -> Error {
        let code = e.code().map(|c| c.code().to_string()).unwrap_or_default();
        let text = format!("prune: {what}: {}", describe(&e));
        let error = match code.as_str() {
            "42501" => Error::source(text).remedy(
                "GRANT SELECT, DELETE on the outbox tables to the user in prune.url (or source.url); drop_partitions also needs to own the partitions",
            ),
            "25006" => Error::source(text).remedy("the server is read-only (a standby?): set prune.url to the primary"),
            "42703" => Error::config(text).remedy(
                "set prune.column to the outbox table's creation-time column (DEFAULT now())",
            ),
            "55P03" => Error::source(text)
                .remedy("a long transaction holds the table; outboxd tries again next time")
                .transient(),
            c if super::control::transient_sqlstate(c) || c.is_empty() => Error::source(text)
                .remedy("outboxd tries again next time")
                .transient(),
            _ => Error::source(text),
        };
        error.caused_by(e)
    }

    /// Samples the oldest running transaction and the WAL end (see the module docs).
    pub async fn sample(&mut self, older_than_secs: u64) -> Result<Sample> {
        let row = self
            .control
            .client()
            .query_one(
                "SELECT pg_snapshot_xmin(pg_current_snapshot())::text, pg_current_wal_insert_lsn()::text",
                &[],
            )
            .await
            .map_err(|e| self.failed("reading the oldest running transaction", e))?;
        let xmin: String = row.get(0);
        let lsn: String = row.get(1);
        let xmin = xmin
            .parse::<u64>()
            .map_err(|_| Error::source(format!("prune: {xmin:?} is not a transaction id")))?;
        let lsn = parse_lsn(&lsn)
            .ok_or_else(|| Error::source(format!("prune: {lsn:?} is not an LSN")))?;
        Ok(Sample {
            log_end: position(lsn),
            // Ages are computed on 32-bit ids, as the xmin column holds them.
            xmin: (xmin & 0xffff_ffff) as u32,
            older_than_secs,
            shown: format!("transactions before {xmin}"),
        })
    }

    /// Deletes up to `batch` rows of `table` that the sample lets go; returns how many.
    pub async fn delete_batch(
        &mut self,
        table: &str,
        column: &str,
        sample: &Sample,
        batch: u64,
    ) -> Result<u64> {
        let condition = format!(
            "{} < now() - interval '{} seconds' AND (age(xmin) > age('{}'::xid) OR age(xmin) < 0)",
            quote_ident(column),
            sample.older_than_secs,
            sample.xmin
        );
        let t = quote_table(table);
        let statement = format!(
            "DELETE FROM {t} WHERE (tableoid, ctid) IN \
             (SELECT tableoid, ctid FROM {t} WHERE {condition} LIMIT {batch}) AND {condition}"
        );
        self.control
            .client()
            .execute(statement.as_str(), &[])
            .await
            .map_err(|e| self.failed(&format!("deleting from {table}"), e))
    }

    /// Drops the partitions of `table` whose upper bound is at or before `now() - older_than` and
    /// that hold no row newer than the sample; returns their names.
    pub async fn drop_partitions(
        &mut self,
        table: &str,
        column: &str,
        sample: &Sample,
    ) -> Result<Vec<String>> {
        let (schema, name) = split_table(table);
        let client = self.control.client();
        let key: Option<String> = client
            .query_opt(
                "SELECT pg_get_partkeydef(c.oid) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relname = $2",
                &[&schema, &name],
            )
            .await
            .map_err(|e| self.failed(&format!("reading how {table} is partitioned"), e))?
            .and_then(|row| row.get(0));
        let Some(key) = key else {
            return Err(Error::config(format!(
                "prune.mode = \"drop_partitions\", but {table} is not a partitioned table"
            ))
            .remedy("partition it BY RANGE on its creation time, or use prune.mode = \"delete\""));
        };
        let expected = [
            format!("RANGE ({column})"),
            format!("RANGE ({})", quote_ident(column)),
        ];
        if !expected.contains(&key) {
            return Err(Error::config(format!(
                "prune.mode = \"drop_partitions\": {table} is partitioned {key}, not RANGE ({column})"
            ))
            .remedy("partition BY RANGE (the prune.column), or use prune.mode = \"delete\""));
        }
        // Each partition, with whether its upper bound is at or before the retention time. The
        // bound is compared by the server in the column's own type.
        let rows = client
            .query(
                "SELECT c.oid::regclass::text, pg_get_expr(c.relpartbound, c.oid) \
                 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                 JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE i.inhparent = (SELECT c2.oid FROM pg_class c2 JOIN pg_namespace n2 ON n2.oid = c2.relnamespace WHERE n2.nspname = $1 AND c2.relname = $2)",
                &[&schema, &name],
            )
            .await
            .map_err(|e| self.failed(&format!("reading the partitions of {table}"), e))?;
        let column_type: String = client
            .query_one(
                "SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a \
                 JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relname = $2 AND a.attname = $3",
                &[&schema, &name, &column],
            )
            .await
            .map_err(|e| self.failed(&format!("reading the type of {table}.{column}"), e))?
            .get(0);
        let mut dropped = Vec::new();
        for row in rows {
            let partition: String = row.get(0);
            let bound: String = row.get(1);
            let Some(upper) = upper_bound(&bound) else {
                continue;
            };
            let behind: bool = client
                .query_one(
                    format!(
                        "SELECT ({upper})::{column_type} <= (now() - interval '{} seconds')::{column_type}",
                        sample.older_than_secs
                    )
                    .as_str(),
                    &[],
                )
                .await
                .map_err(|e| self.failed(&format!("comparing partition {partition}"), e))?
                .get(0);
            if !behind {
                continue;
            }
            if self.drop_one(&partition, sample).await? {
                dropped.push(partition);
            }
        }
        Ok(dropped)
    }

    /// Drops `partition` (already a quoted, qualified name from the server) if no row in it is
    /// newer than the sample, holding its lock while looking.
    async fn drop_one(&self, partition: &str, sample: &Sample) -> Result<bool> {
        let client = self.control.client();
        let work = async {
            client.batch_execute("BEGIN").await?;
            client
                .batch_execute(&format!(
                    "SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'; LOCK TABLE {partition} IN ACCESS EXCLUSIVE MODE"
                ))
                .await?;
            let newer: bool = client
                .query_one(
                    format!(
                        "SELECT EXISTS (SELECT 1 FROM {partition} WHERE age(xmin) >= 0 AND age(xmin) <= age('{}'::xid))",
                        sample.xmin
                    )
                    .as_str(),
                    &[],
                )
                .await?
                .get(0);
            if newer {
                client.batch_execute("ROLLBACK").await?;
                return Ok(false);
            }
            client
                .batch_execute(&format!("DROP TABLE {partition}; COMMIT"))
                .await?;
            Ok::<bool, tokio_postgres::Error>(true)
        };
        match work.await {
            Ok(done) => Ok(done),
            Err(e) => {
                let _ = client.batch_execute("ROLLBACK").await;
                Err(self.failed(&format!("dropping partition {partition}"), e))
            }
        }
    }

    /// The server's estimate of the rows in `tables` (live tuples, partitions included).
    pub async fn estimate_rows(&mut self, tables: &[String]) -> Result<u64> {
        let mut total = 0i64;
        for table in tables {
            let (schema, name) = split_table(table);
            let row = self
                .control
                .client()
                .query_one(
                    "SELECT COALESCE(sum(s.n_live_tup), 0)::bigint FROM pg_stat_user_tables s \
                     WHERE (s.schemaname = $1 AND s.relname = $2) OR s.relid IN \
                     (SELECT i.inhrelid FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhparent \
                      JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = $2)",
                    &[&schema, &name],
                )
                .await
                .map_err(|e| self.failed("estimating the outbox rows", e))?;
            total += row.get::<_, i64>(0);
        }
        Ok(total.max(0) as u64)
    }
}

fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => db.message().to_string(),
        None => e.to_string(),
    }
}

/// The `TO (…)` literal of a range partition's bound; None for DEFAULT and MAXVALUE bounds.
fn upper_bound(bound: &str) -> Option<&str> {
    let (_, upper) = bound.split_once(" TO (")?;
    let upper = upper.strip_suffix(')')?.trim();
    (!upper.eq_ignore_ascii_case("MAXVALUE") && !upper.contains(',')).then_some(upper)
}

#[cfg(test)]
mod tests {
    use super::upper_bound;

    #[test]
    fn the_upper_bound_of_a_range_partition_is_read_from_its_definition() {
        assert_eq!(
            upper_bound("FOR VALUES FROM ('2000-01-01 00:00:00+00') TO ('2001-01-01 00:00:00+00')"),
            Some("'2001-01-01 00:00:00+00'")
        );
        assert_eq!(
            upper_bound("FOR VALUES FROM ('2001-01-01') TO (MAXVALUE)"),
            None
        );
        assert_eq!(upper_bound("DEFAULT"), None);
    }
}
