//! What a preflight finds: one PASS/WARN/FAIL line per requirement, as plain data. Sources and the
//! sink produce these; `check` (and `run`'s start) collects and judges them. A leaf: it knows no
//! source, sink or config.

use std::fmt;

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
/// it must have every column the route reads (`wanted`).
pub fn routed_columns_item(
    subject: &str,
    table: &str,
    columns: &[String],
    wanted: &[String],
    schema_kind: &str,
) -> Item {
    if columns.is_empty() {
        return Item::fail(
            subject,
            format!("outbox table {table} does not exist (or the user cannot see it)"),
            format!("create it (see `outboxd schema --kind {schema_kind}`) or fix source.tables; GRANT SELECT on it"),
        );
    }
    let missing: Vec<&str> = wanted
        .iter()
        .filter(|w| !columns.iter().any(|c| c == *w))
        .map(String::as_str)
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
