//! The database side of retention: one [`Pruner`] over either source's SQL (`mysql/prune.rs`,
//! `postgres/prune.rs`). `crate::retention` decides when it may delete; this only samples, deletes
//! and drops what the sample lets go.

use super::config::{SourceConfig, SourceKind};
use super::{mysql, postgres, Position};
use crate::error::{Error, Result};

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
    /// go is deleted, and a description of it for the log.
    pub async fn sample(&mut self, older_than_secs: u64) -> Result<(Position, String)> {
        match &mut self.0 {
            Db::Mysql(p, sample) => {
                let s = p.sample(older_than_secs).await?;
                let out = (
                    s.log_end.clone(),
                    format!("rows created before {}", s.shown),
                );
                *sample = Some(s);
                Ok(out)
            }
            Db::Postgres(p, sample) => {
                let s = p.sample(older_than_secs).await?;
                let out = (s.log_end.clone(), s.shown.clone());
                *sample = Some(s);
                Ok(out)
            }
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
