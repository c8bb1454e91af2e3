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
use crate::preflight::Item;
use crate::source::config::SourceConfig;
use crate::source::config::SourceKind;
use crate::source::prune::{fail_item, Ahead};
use crate::source::{Position, SourceIdentity};

/// How long dropping a partition waits for its lock (inserts into the table queue behind it).
const LOCK_TIMEOUT: &str = "2s";

pub struct Pruner {
    control: Control,
    /// The replication slot the stream confirms its durable position to.
    slot: Option<String>,
}

/// What a sample found: the WAL end, the oldest running transaction, and the retention time.
pub struct Sample {
    pub log_end: Position,
    xmin: u32,
    older_than_secs: u64,
    pub shown: String,
    /// The cluster sampled (its system identifier when the user may read it).
    pub identity: SourceIdentity,
}

impl Pruner {
    pub async fn connect(config: &SourceConfig) -> Result<Pruner> {
        let info = ConnInfo::from_config(config)?;
        let slot = match &config.db {
            crate::source::config::SourceDb::Postgres(own) => Some(own.slot.clone()),
            _ => None,
        };
        Ok(Pruner {
            control: Control::connect(&info).await?,
            slot,
        })
    }

    pub fn slot_name(&self) -> Option<&str> {
        self.slot.as_deref()
    }

    /// The position the stream's slot has confirmed on this server (it confirms only what the
    /// durable checkpoint holds): None when there is no such slot here, which means the
    /// checkpoint was not written against this server.
    pub async fn slot_confirmed(&self) -> Result<Option<Position>> {
        let Some(slot) = &self.slot else {
            return Ok(None);
        };
        let row = self
            .control
            .client()
            .query_opt(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                &[slot],
            )
            .await
            .map_err(|e| self.failed("reading the replication slot", e))?;
        Ok(row
            .and_then(|r| r.get::<_, Option<String>>(0))
            .and_then(|text| parse_lsn(&text))
            .map(position))
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
            // The cluster is vouched for by the slot instead (`slot_confirmed`).
            identity: SourceIdentity::anonymous(SourceKind::Postgres),
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
        let (rows, column_type) = self.layout(table, column).await?;
        let client = self.control.client();
        let mut dropped = Vec::new();
        for (partition, bound) in rows {
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

    /// `table`'s partitions (qualified, quoted name; bound as the server shows it) and the type of
    /// `column`; an error unless `table` is partitioned BY RANGE on `column`.
    async fn layout(&self, table: &str, column: &str) -> Result<(Vec<(String, String)>, String)> {
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
                "prune (drop_partitions, partitions_ahead): {table} is not a partitioned table"
            ))
            .remedy("partition it BY RANGE on its creation time, or use prune.mode = \"delete\""));
        };
        let expected = [
            format!("RANGE ({column})"),
            format!("RANGE ({})", quote_ident(column)),
        ];
        if !expected.contains(&key) {
            return Err(Error::config(format!(
                "prune (drop_partitions, partitions_ahead): {table} is partitioned {key}, not RANGE ({column})"
            ))
            .remedy("partition BY RANGE (the prune.column), or use prune.mode = \"delete\""));
        }
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
        let rows = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        Ok((rows, column_type))
    }

    /// Creates the partitions `plan` asks for after `table`'s last upper bound (each in its own
    /// transaction, waiting at most [`LOCK_TIMEOUT`] for the table), named `<table>_p<first day>`
    /// beside it; returns their names. Nothing when a partition already reaches MAXVALUE.
    pub async fn create_partitions(
        &mut self,
        table: &str,
        column: &str,
        plan: &Ahead,
    ) -> Result<Vec<String>> {
        let (rows, column_type) = self.layout(table, column).await?;
        // A partition reaching MAXVALUE or infinity leaves nothing to add (and nothing could be).
        let endless = |b: &str| b.contains("TO (MAXVALUE)") || b.contains("'infinity'");
        if let Some((partition, _)) = rows.iter().find(|(_, b)| endless(b)) {
            tracing::debug!(%partition, "prune: a partition reaches MAXVALUE; none to create");
            return Ok(Vec::new());
        }
        // Creating a partition scans a DEFAULT partition under the table's lock: refused here.
        if let Some((partition, _)) = rows.iter().find(|(_, b)| b == "DEFAULT") {
            return Err(Error::config(format!(
                "prune.partitions_ahead: {table} has a DEFAULT partition ({partition}); creating a partition would scan it while inserts wait"
            ))
            .remedy("detach or drop the DEFAULT partition (move its rows into range partitions first), or create partitions by hand"));
        }
        let uppers: Vec<&str> = rows.iter().filter_map(|(_, b)| upper_bound(b)).collect();
        let seconds = |t: &str| format!("floor(extract(epoch from ({t})::{column_type}))::bigint");
        let each: Vec<String> = uppers.iter().map(|u| seconds(u)).collect();
        let client = self.control.client();
        let row = client
            .query_one(
                format!(
                    "SELECT ARRAY[{}]::bigint[], {}",
                    each.join(", "),
                    seconds("now()")
                )
                .as_str(),
                &[],
            )
            .await
            .map_err(|e| self.failed(&format!("reading the last bound of {table}"), e))?;
        let (each, now): (Vec<i64>, i64) = (row.get(0), row.get(1));
        // The last bound, and the literal it was written with: the first new partition's start
        // (with no partition yet, the first new one starts at MINVALUE).
        let (last, mut from) = each
            .into_iter()
            .zip(uppers.iter().map(|u| u.to_string()))
            .max_by_key(|(at, _)| *at)
            .unwrap_or((i64::MIN / 4, "MINVALUE".to_string()));
        // timestamptz, timestamptz(6): bounds in UTC, whatever the session's TimeZone.
        let zone = if column_type.ends_with("with time zone") {
            "+00"
        } else {
            ""
        };
        let (schema, name) = split_table(table);
        let mut created = Vec::new();
        for new in plan.plan(last, now) {
            let partition = format!("{name}_{}", new.suffix);
            if partition.len() > 63 {
                return Err(Error::config(format!(
                    "prune.partitions_ahead: the partition name {partition:?} is longer than Postgres allows (63 bytes)"
                ))
                .remedy("create the partitions by hand, or use a shorter table name"));
            }
            let to = format!("'{}{zone}'", new.literal);
            let statement = format!(
                "BEGIN; SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'; \
                 CREATE TABLE {}.{} PARTITION OF {} FOR VALUES FROM ({from}) TO ({to}); COMMIT",
                quote_ident(schema),
                quote_ident(&partition),
                quote_table(table),
            );
            if let Err(e) = client.batch_execute(&statement).await {
                let _ = client.batch_execute("ROLLBACK").await;
                return Err(self.failed(&format!("creating partition {partition}"), e));
            }
            created.push(partition);
            from = to;
        }
        Ok(created)
    }

    /// What `check` reports for pruning `tables`: the column, DELETE (delete mode), the partition
    /// key and owning the table and its partitions (drop_partitions, partitions_ahead), CREATE on
    /// the schema (partitions_ahead). Asked of the catalog; nothing is changed.
    pub async fn preflight(
        &mut self,
        tables: &[String],
        column: &str,
        deletes: bool,
        partitions: bool,
        creates: bool,
    ) -> Vec<Item> {
        let mut items = Vec::new();
        match self.sample(0).await {
            Ok(_) => items.push(Item::pass(
                "prune",
                "reads the oldest running transaction and the WAL end",
            )),
            Err(e) => items.push(fail_item(&e)),
        }
        for table in tables {
            match self
                .table_preflight(table, column, deletes, partitions, creates)
                .await
            {
                Ok(found) => items.push(Item::pass("prune", format!("{table}: {found}"))),
                Err(e) => items.push(fail_item(&e)),
            }
        }
        items
    }

    async fn table_preflight(
        &self,
        table: &str,
        column: &str,
        deletes: bool,
        partitions: bool,
        creates: bool,
    ) -> Result<String> {
        let client = self.control.client();
        let (schema, _) = split_table(table);
        let row = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = $1::text::regclass \
                 AND attname = $2 AND NOT attisdropped AND attnum > 0), \
                 has_table_privilege($1::text::regclass, 'DELETE'), \
                 (SELECT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE oid = $1::text::regclass), \
                 COALESCE((SELECT bool_and(pg_has_role(c.relowner, 'USAGE')) FROM pg_inherits i \
                   JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = $1::text::regclass), true), \
                 has_schema_privilege($3, 'CREATE')",
                &[&quote_table(table), &column, &schema],
            )
            .await
            .map_err(|e| self.failed(&format!("reading {table}"), e))?;
        let (has_column, delete, owner, owns_partitions, create): (bool, bool, bool, bool, bool) =
            (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        let refused = |what: String, fix: &str| {
            Err(Error::config(format!("prune: {table}: {what}")).remedy(fix.to_string()))
        };
        if !has_column {
            return refused(
                format!("has no column {column:?}"),
                "set prune.column to the outbox table's creation-time column (DEFAULT now())",
            );
        }
        let mut found = vec![format!("column {column}")];
        if deletes {
            if !delete {
                return refused(
                    "the user may not DELETE".into(),
                    "GRANT DELETE on the outbox tables to the user in prune.url (or source.url)",
                );
            }
            found.push("DELETE".into());
        }
        // `partitions`: dropping them (owning each); `creates`: adding them (owning the table).
        if partitions || creates {
            self.layout(table, column).await?;
            if !owner || (partitions && !owns_partitions) {
                return refused(
                    "the user does not own the table (and, to drop them, its partitions)".into(),
                    "ALTER TABLE … OWNER TO the user in prune.url (or source.url), or GRANT it the owner's role",
                );
            }
            found.push(format!("partitioned BY RANGE ({column}), owned"));
        }
        if creates {
            if !create {
                return refused(
                    format!("the user may not create tables in schema {schema}"),
                    "GRANT CREATE ON SCHEMA … TO the user in prune.url (or source.url)",
                );
            }
            found.push("CREATE on the schema".into());
        }
        Ok(found.join(", "))
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
