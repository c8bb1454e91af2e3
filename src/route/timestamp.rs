//! The record timestamp: a column's value (Debezium `table.field.event.timestamp`) or, by default,
//! when the source transaction committed (what the log says; Debezium's `source.ts_ms`).
//!
//! A column may hold a date-time (MySQL DATETIME/TIMESTAMP, Postgres timestamp/timestamptz; a value
//! without an offset is UTC, as MySQL's binlog and outboxd's rendering give it) or a number of
//! milliseconds since the Unix epoch.

use chrono::{DateTime, NaiveDateTime};

use crate::source::Value;

/// Milliseconds since the Unix epoch for `value`; `Err` says why it is not a time.
pub fn millis(value: &Value) -> Result<Option<i64>, String> {
    match value {
        Value::Null => Ok(None),
        Value::Int(ms) => Ok(Some(*ms)),
        Value::UInt(ms) => i64::try_from(*ms)
            .map(Some)
            .map_err(|_| format!("{ms} is out of range")),
        Value::Temporal(text) | Value::Text(text) => parse(text)
            .map(Some)
            .ok_or_else(|| format!("{text:?} is not a date-time")),
        other => Err(format!(
            "{} is not a date-time or epoch milliseconds",
            other.render().unwrap_or_default()
        )),
    }
}

fn parse(text: &str) -> Option<i64> {
    let text = text.trim();
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Some(t.timestamp_millis());
    }
    // Postgres text output: "2024-05-01 12:00:00.123+02" (offset in hours, maybe minutes).
    for format in ["%Y-%m-%d %H:%M:%S%.f%#z", "%Y-%m-%dT%H:%M:%S%.f%#z"] {
        if let Ok(t) = DateTime::parse_from_str(text, format) {
            return Some(t.timestamp_millis());
        }
    }
    for format in [
        "%Y-%m-%dT%H:%M:%S%.f",
        "%Y-%m-%d %H:%M:%S%.f",
        "%Y-%m-%dT%H:%M:%S",
        "%Y-%m-%d %H:%M:%S",
    ] {
        if let Ok(t) = NaiveDateTime::parse_from_str(text, format) {
            return Some(t.and_utc().timestamp_millis());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn date_times_and_epoch_millis() {
        let at = 1_714_564_800_123; // 2024-05-01T12:00:00.123Z
        for text in [
            "2024-05-01T12:00:00.123Z",
            "2024-05-01T12:00:00.123000",
            "2024-05-01 12:00:00.123",
            "2024-05-01 14:00:00.123+02",
            "2024-05-01 14:30:00.123+02:30",
        ] {
            assert_eq!(
                millis(&Value::Temporal(text.into())),
                Ok(Some(at)),
                "{text}"
            );
        }
        assert_eq!(millis(&Value::Int(at)), Ok(Some(at)));
        assert_eq!(millis(&Value::Null), Ok(None));
        assert!(millis(&Value::Text("yesterday".into())).is_err());
        assert!(millis(&Value::Binary(vec![1])).is_err());
    }
}
