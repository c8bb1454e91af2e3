//! The record timestamp: a column's value (Debezium `table.field.event.timestamp`) or, by default,
//! when the source transaction committed, as the log says. (Debezium's default is the time it
//! processed the change; a commit time stays true when outboxd catches up on a backlog.)
//!
//! A column may hold a date-time (MySQL DATETIME/TIMESTAMP, Postgres timestamp/timestamptz; a value
//! without an offset is UTC, as MySQL's binlog and outboxd's rendering give it) or a number of
//! milliseconds since the Unix epoch. MySQL's zero date counts as no value. Numbers below
//! 10^11 (March 1973 in milliseconds) are refused: they are seconds, or not times at all, and a
//! record stamped 1970 would fall to time-based retention at once.

use chrono::{DateTime, NaiveDateTime};

use crate::source::Value;

/// The smallest number taken for epoch milliseconds.
const MIN_MILLIS: i64 = 100_000_000_000;
/// The largest (the year 2286): beyond are microseconds or nonsense, which a broker refuses
/// (`message.timestamp.after.max.ms`) or keeps forever.
const MAX_MILLIS: i64 = 10_000_000_000_000;

/// Milliseconds since the Unix epoch for `value` (`None`: no value); `Err` says why it is not a
/// time.
pub fn millis(value: &Value) -> Result<Option<i64>, String> {
    let number = |ms: i64| {
        if (MIN_MILLIS..=MAX_MILLIS).contains(&ms) {
            Ok(Some(ms))
        } else {
            Err(format!(
                "{ms} is not epoch milliseconds (seconds or microseconds? the column must hold milliseconds or a date-time)"
            ))
        }
    };
    match value {
        Value::Null => Ok(None),
        Value::Int(ms) => number(*ms),
        Value::UInt(ms) => i64::try_from(*ms)
            .map_err(|_| format!("{ms} is not epoch milliseconds"))
            .and_then(number),
        Value::Temporal(text) | Value::Text(text) if text.starts_with("0000-00-00") => Ok(None),
        Value::Temporal(text) | Value::Text(text) => match parse(text) {
            Some(ms) if (1..=MAX_MILLIS).contains(&ms) => Ok(Some(ms)),
            Some(_) => Err(format!("{text:?} is before 1970 or after 2286")),
            None => Err(format!("{text:?} is not a date-time")),
        },
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
