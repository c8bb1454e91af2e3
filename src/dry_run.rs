//! `replay --binlog-file … --dry-run`: the records binlog files would produce, one JSON object per
//! line, without contacting Kafka. For audits ("what did this file put in the outbox?") and for
//! checking a route before replaying for real.

use std::io::Write;
use std::path::PathBuf;

use base64::Engine;
use serde_json::{json, Value as Json};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::source::mysql::BinlogFileSource;
use crate::source::{Change, Position};

/// Text when the bytes are UTF-8, else `{"base64": …}`.
fn bytes_json(bytes: Option<&[u8]>) -> Json {
    match bytes {
        None => Json::Null,
        Some(b) => match std::str::from_utf8(b) {
            Ok(s) => Json::String(s.to_string()),
            Err(_) => json!({ "base64": base64::engine::general_purpose::STANDARD.encode(b) }),
        },
    }
}

/// Writes one line per outbox row of `paths` (records, or `unroutable` entries) to `out`; returns the
/// number of rows.
pub fn binlog_files(
    config: &Config,
    paths: Vec<PathBuf>,
    from: Option<&Position>,
    to: Option<&Position>,
    out: &mut impl Write,
) -> Result<u64> {
    let mut source = BinlogFileSource::open(paths, config.source.tables.iter().cloned(), from)?;
    let router = config.sink().router(&config.route);
    let mut rows = 0;
    loop {
        let line = match source.next_change()? {
            Change::Row(row) => {
                rows += 1;
                match router.route(&row) {
                    Ok(record) => {
                        let headers: serde_json::Map<String, Json> = record
                            .headers
                            .iter()
                            .map(|(k, v)| (k.clone(), bytes_json(v.as_deref())))
                            .collect();
                        json!({
                            "topic": record.topic,
                            "key": bytes_json(record.key.as_deref()),
                            "value": bytes_json(record.value.as_deref()),
                            "headers": headers,
                            "table": &*row.table,
                        })
                    }
                    Err(why) => {
                        let columns: serde_json::Map<String, Json> = row
                            .names
                            .iter()
                            .zip(&row.values)
                            .map(|(n, v)| (n.to_string(), v.to_json()))
                            .collect();
                        json!({
                            "unroutable": why.reason,
                            "detail": why.detail,
                            "table": &*row.table,
                            "position": &*row.origin,
                            "row": columns,
                        })
                    }
                }
            }
            Change::Commit(b) | Change::Idle(b) => {
                if to.is_some_and(|to| b.position.reached(to)) {
                    return Ok(rows);
                }
                continue;
            }
            Change::Exhausted => return Ok(rows),
        };
        writeln!(out, "{line}")
            .map_err(|e| Error::config(format!("cannot write the dry-run output: {e}")))?;
    }
}
