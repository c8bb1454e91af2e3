//! The database side of retention: one [`Pruner`] over either source's SQL (`mysql/prune.rs`,
//! `postgres/prune.rs`). `crate::retention` decides when it may delete; this only samples, deletes
//! and drops what the sample lets go.

use super::config::{SourceConfig, SourceKind};
use super::{mysql, postgres, Position, SourceIdentity};
use crate::error::{Error, Result};
use crate::preflight::Item;

/// `check`'s line for a prune step that failed: FAIL, or "unreachable" when trying again may cure it.
pub(crate) fn fail_item(e: &Error) -> Item {
    let message = e.message();
    let message = message
        .strip_prefix("prune: ")
        .unwrap_or(message)
        .to_string();
    let remedy = e.remedy_text().unwrap_or_default();
    if e.is_transient() {
        Item::unreachable("prune", message, remedy)
    } else {
        Item::fail("prune", message, remedy)
    }
}

/// Creating partitions ahead (`prune.partitions_ahead` of `prune.partition_every` each): the
/// partition maintainer of a polling relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ahead {
    /// Width of each new partition, seconds.
    pub every: i64,
    /// How many whole widths past now must be covered.
    pub count: u32,
}

/// One partition to create: `[previous upper bound, upper)`, named after the period it is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewPartition {
    /// Upper bound as wall-clock seconds since 1970-01-01 00:00:00 (UTC for time zone aware
    /// columns, the server's wall clock otherwise).
    pub upper: i64,
    /// The bound as a literal the server casts to the column: `2026-11-24` or
    /// `2026-11-24 06:00:00`.
    pub literal: String,
    /// `p20261123` (or `p20261123_060000` when `every` is not whole days).
    pub suffix: String,
}

impl Ahead {
    /// The partitions to add after the last finite upper bound `last` so that rows stamped from
    /// `now` until `count` widths later have one. Bounds sit on a grid of `every` from 1970-01-01
    /// (so daily partitions start at midnight); the first new one starts at `last` and, when `last`
    /// is already behind, reaches past `now` in one step (a catch-up partition instead of one per
    /// missed period). At most `count + 1` partitions; none when `last` is past the horizon.
    pub fn plan(&self, last: i64, now: i64) -> Vec<NewPartition> {
        let every = self.every.max(1);
        let next = |t: i64| (t.div_euclid(every) + 1) * every;
        let horizon = now.saturating_add(every.saturating_mul(self.count as i64));
        let mut out = Vec::new();
        if last > horizon {
            return out;
        }
        let mut upper = next(last).max(next(now));
        loop {
            out.push(NewPartition {
                upper,
                literal: literal(upper),
                suffix: suffix(upper - every, every),
            });
            if upper > horizon {
                return out;
            }
            upper += every;
        }
    }
}

fn civil(seconds: i64) -> String {
    // Before 1970 does not occur: every new bound is past now.
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(seconds.max(0) as u64);
    humantime::format_rfc3339_seconds(at).to_string()
}

fn literal(seconds: i64) -> String {
    let text = civil(seconds); // 2026-11-24T06:00:00Z
    let (date, time) = (&text[..10], &text[11..19]);
    if time == "00:00:00" {
        date.to_string()
    } else {
        format!("{date} {time}")
    }
}

fn suffix(start: i64, every: i64) -> String {
    let digits: String = civil(start).chars().filter(char::is_ascii_digit).collect();
    if every % 86_400 == 0 {
        format!("p{}", &digits[..8])
    } else {
        format!("p{}_{}", &digits[..8], &digits[8..14])
    }
}

enum Db {
    Mysql(mysql::prune::Pruner, Option<mysql::prune::Sample>),
    Postgres(postgres::prune::Pruner, Option<postgres::prune::Sample>),
}

/// A connection that prunes one server's outbox tables.
pub struct Pruner(Db);

fn no_sample() -> Error {
    Error::source("prune: delete before a sample (a bug)")
}

impl Pruner {
    pub async fn connect(config: &SourceConfig) -> Result<Pruner> {
        Ok(Pruner(match config.kind() {
            SourceKind::Mysql => Db::Mysql(mysql::prune::Pruner::connect(config).await?, None),
            SourceKind::Postgres => {
                Db::Postgres(postgres::prune::Pruner::connect(config).await?, None)
            }
        }))
    }

    /// Takes a new sample: returns the log end the checkpoint must cover before anything it lets
    /// go is deleted, a description of it for the log, and the server sampled.
    pub async fn sample(
        &mut self,
        older_than_secs: u64,
    ) -> Result<(Position, String, SourceIdentity)> {
        match &mut self.0 {
            Db::Mysql(p, sample) => {
                let s = p.sample(older_than_secs).await?;
                let out = (
                    s.log_end.clone(),
                    format!("rows created before {}", s.shown),
                    s.identity.clone(),
                );
                *sample = Some(s);
                Ok(out)
            }
            Db::Postgres(p, sample) => {
                let s = p.sample(older_than_secs).await?;
                let out = (s.log_end.clone(), s.shown.clone(), s.identity.clone());
                *sample = Some(s);
                Ok(out)
            }
        }
    }

    /// Whether this server itself vouches that the stream's durable position reached `log_end`:
    /// Postgres asks the slot (the stream confirms only durable positions to it), so a checkpoint
    /// file from another cluster is never trusted; MySQL has no such record (Some(true)). None:
    /// there is no slot here.
    pub async fn server_confirms(&mut self, log_end: &Position) -> Result<Option<bool>> {
        match &mut self.0 {
            Db::Mysql(..) => Ok(Some(true)),
            Db::Postgres(p, _) => Ok(p.slot_confirmed().await?.map(|c| c.reached(log_end))),
        }
    }

    /// The slot whose confirmation `server_confirms` asks for, for messages.
    pub fn slot(&self) -> Option<&str> {
        match &self.0 {
            Db::Mysql(..) => None,
            Db::Postgres(p, _) => p.slot_name(),
        }
    }

    pub async fn delete_batch(&mut self, table: &str, column: &str, batch: u64) -> Result<u64> {
        match &mut self.0 {
            Db::Mysql(p, Some(s)) => p.delete_batch(table, column, s, batch).await,
            Db::Postgres(p, Some(s)) => p.delete_batch(table, column, s, batch).await,
            _ => Err(no_sample()),
        }
    }

    pub async fn drop_partitions(&mut self, table: &str, column: &str) -> Result<Vec<String>> {
        match &mut self.0 {
            Db::Mysql(p, Some(s)) => p.drop_partitions(table, column, s).await,
            Db::Postgres(p, Some(s)) => p.drop_partitions(table, column, s).await,
            _ => Err(no_sample()),
        }
    }

    /// Creates the partitions `table` lacks so that they cover `plan`'s horizon; returns their
    /// names. Needs no sample: a partition ahead holds no row yet.
    pub async fn create_partitions(
        &mut self,
        table: &str,
        column: &str,
        plan: &Ahead,
    ) -> Result<Vec<String>> {
        match &mut self.0 {
            Db::Mysql(p, _) => p.create_partitions(table, column, plan).await,
            Db::Postgres(p, _) => p.create_partitions(table, column, plan).await,
        }
    }

    /// `check`'s lines: the sample, the column and the privileges the settings need.
    pub async fn preflight(
        &mut self,
        tables: &[String],
        column: &str,
        deletes: bool,
        partitions: bool,
        drops: bool,
        creates: bool,
    ) -> Vec<Item> {
        match &mut self.0 {
            Db::Mysql(p, _) => {
                p.preflight(tables, column, deletes, partitions, drops)
                    .await
            }
            Db::Postgres(p, _) => p.preflight(tables, column, deletes, drops, creates).await,
        }
    }

    pub async fn estimate_rows(&mut self, tables: &[String]) -> Result<u64> {
        match &mut self.0 {
            Db::Mysql(p, _) => p.estimate_rows(tables).await,
            Db::Postgres(p, _) => p.estimate_rows(tables).await,
        }
    }

    pub async fn close(self) {
        if let Db::Mysql(p, _) = self.0 {
            p.close().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Ahead;

    const DAY: i64 = 86_400;

    #[test]
    fn partitions_ahead_start_at_the_last_bound_and_cover_the_horizon_on_the_grid() {
        let daily = Ahead {
            every: DAY,
            count: 2,
        };
        // 2026-11-23 15:00 UTC; the last partition ends at midnight 2026-11-24.
        let now = 20_780 * DAY + 15 * 3600;
        let last = 20_781 * DAY;
        let plan = daily.plan(last, now);
        let shown: Vec<_> = plan
            .iter()
            .map(|p| (p.suffix.as_str(), p.literal.as_str()))
            .collect();
        assert_eq!(
            shown,
            [("p20261124", "2026-11-25"), ("p20261125", "2026-11-26")]
        );
        // Covered already: nothing; one more day passes: one more.
        assert!(daily.plan(20_783 * DAY, now).is_empty());
        assert_eq!(daily.plan(20_783 * DAY, now + DAY).len(), 1);
        // Years behind: one catch-up partition reaching past now, then the rest.
        let behind = daily.plan(11_323 * DAY, now);
        assert_eq!(behind.len(), 3);
        assert_eq!(behind[0].literal, "2026-11-24");
        assert_eq!(behind[0].suffix, "p20261123");
        let hourly = Ahead {
            every: 3600,
            count: 1,
        };
        let plan = hourly.plan(now - 1800, now);
        assert_eq!(plan[0].literal, "2026-11-23 16:00:00");
        assert_eq!(plan[0].suffix, "p20261123_150000");
        assert_eq!(plan.len(), 2);
    }
}
