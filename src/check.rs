//! Preflight: one PASS/WARN/FAIL line per requirement, each FAIL with the command that fixes it.
//!
//! `outboxd check` prints the report and exits 1 on any FAIL. `outboxd run` performs the same checks at
//! start and refuses to start on a misconfiguration; "cannot reach" results do not block `run`, because
//! the pipeline's own reconnect loop handles servers that are merely not up yet.

use std::fmt;

use crate::checkpoint::Store;
use crate::config::{Config, SourceKind};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Pass,
    /// Works, but not as recommended.
    Warn,
    /// Misconfigured: `run` refuses to start.
    Fail,
    /// Could not be checked because the server did not answer: FAIL for `check`, a retry for `run`.
    Unreachable,
}

#[derive(Debug, Clone)]
pub struct Item {
    pub status: Status,
    pub subject: String,
    pub detail: String,
    pub remedy: Option<String>,
}

impl Item {
    pub fn pass(subject: &str, detail: impl Into<String>) -> Item {
        Item {
            status: Status::Pass,
            subject: subject.into(),
            detail: detail.into(),
            remedy: None,
        }
    }

    pub fn warn(subject: &str, detail: impl Into<String>, remedy: impl Into<String>) -> Item {
        Item {
            status: Status::Warn,
            subject: subject.into(),
            detail: detail.into(),
            remedy: Some(remedy.into()),
        }
    }

    pub fn fail(subject: &str, detail: impl Into<String>, remedy: impl Into<String>) -> Item {
        Item {
            status: Status::Fail,
            subject: subject.into(),
            detail: detail.into(),
            remedy: Some(remedy.into()),
        }
    }

    pub fn unreachable(
        subject: &str,
        detail: impl Into<String>,
        remedy: impl Into<String>,
    ) -> Item {
        Item {
            status: Status::Unreachable,
            subject: subject.into(),
            detail: detail.into(),
            remedy: Some(remedy.into()),
        }
    }
}

impl fmt::Display for Item {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tag = match self.status {
            Status::Pass => "PASS",
            Status::Warn => "WARN",
            Status::Fail | Status::Unreachable => "FAIL",
        };
        write!(f, "{tag}  {}: {}", self.subject, self.detail)?;
        if let Some(remedy) = &self.remedy {
            if self.status != Status::Pass {
                write!(f, "\n      fix: {remedy}")?;
            }
        }
        Ok(())
    }
}

/// The PASS/FAIL item for outbox table `table` whose columns are `columns` (empty: no such table):
/// it must have every column the route reads.
pub fn routed_columns_item(
    subject: &str,
    config: &Config,
    table: &str,
    columns: &[String],
    schema_kind: &str,
) -> Item {
    if columns.is_empty() {
        return Item::fail(
            subject,
            format!("outbox table {table} does not exist (or the user cannot see it)"),
            format!("create it (see `outboxd schema --kind {schema_kind}`) or fix source.tables; GRANT SELECT on it"),
        );
    }
    let route = &config.route;
    let mut wanted: Vec<&str> = vec![&route.by, &route.key, &route.payload, &route.id];
    wanted.extend(route.headers.values().map(String::as_str));
    let missing: Vec<&str> = wanted
        .into_iter()
        .filter(|w| !columns.iter().any(|c| c == w))
        .collect();
    if missing.is_empty() {
        Item::pass(
            subject,
            format!("outbox table {table} has the routed columns"),
        )
    } else {
        Item::fail(
            subject,
            format!(
                "outbox table {table} lacks the routed column(s) {}",
                missing.join(", ")
            ),
            "add the columns, or point [route] at the table's own column names",
        )
    }
}

pub struct Report {
    pub items: Vec<Item>,
}

impl Report {
    /// Any FAIL, counting unreachable servers.
    pub fn failed(&self) -> bool {
        self.items
            .iter()
            .any(|i| matches!(i.status, Status::Fail | Status::Unreachable))
    }

    /// The misconfigurations that stop `run`.
    pub fn blocking(&self) -> Vec<&Item> {
        self.items
            .iter()
            .filter(|i| i.status == Status::Fail)
            .collect()
    }
}

/// Runs every check for `config`.
pub async fn run(config: &Config) -> Report {
    let mut items = vec![Item::pass("config", "parsed and valid")];
    let checkpoint = match Store::open_unlocked(&config.checkpoint.dir, &config.name) {
        Ok(store) => match store.load() {
            Ok(Some(c)) => {
                items.push(Item::pass(
                    "checkpoint",
                    format!("{} at {}", store.path().display(), c.position),
                ));
                Some(c)
            }
            Ok(None) => {
                items.push(Item::pass(
                    "checkpoint",
                    format!(
                        "none yet at {} (run starts at the source's current end)",
                        store.path().display()
                    ),
                ));
                None
            }
            Err(e) => {
                items.push(Item::fail(
                    "checkpoint",
                    e.message().to_string(),
                    e.remedy_text().unwrap_or("").to_string(),
                ));
                None
            }
        },
        Err(e) => {
            items.push(Item::fail(
                "checkpoint",
                e.message().to_string(),
                e.remedy_text().unwrap_or("").to_string(),
            ));
            None
        }
    };
    match config.source.kind {
        SourceKind::Mysql => {
            for url in crate::config::source_urls(&config.source.url) {
                let mut one = config.clone();
                one.source.url = url;
                items.extend(crate::source::mysql::preflight(&one, checkpoint.as_ref()).await)
            }
        }
        SourceKind::Postgres => {
            items.extend(crate::source::postgres::preflight(config, checkpoint.as_ref()).await)
        }
    }
    items.extend(crate::sink::kafka::preflight(config).await);
    Report { items }
}
