//! The router: a pure function from an outbox row to a Kafka record. No I/O.
//!
//! Defaults follow Debezium's Outbox Event Router so a consumer written for Debezium reads outboxd's
//! records unchanged: topic `outbox.event.${routedByValue}` from `aggregatetype`, key `aggregateid`,
//! value `payload` as stored, header `id`. outboxd adds the header `outboxd.position` (where the row's
//! transaction starts in the source log). A row that cannot become a valid record is [`Unroutable`]
//! with a reason that labels the dead-letter metric.

use std::collections::BTreeMap;

use crate::source::{Row, Value};

/// How a row becomes a Kafka record. Defaults are those of Debezium's Outbox Event Router.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouteConfig {
    pub by: String,
    pub topic: String,
    pub key: String,
    pub payload: String,
    pub id: String,
    pub headers: BTreeMap<String, String>,
}

impl Default for RouteConfig {
    fn default() -> Self {
        RouteConfig {
            by: "aggregatetype".into(),
            topic: "outbox.event.${routedByValue}".into(),
            key: "aggregateid".into(),
            payload: "payload".into(),
            id: "id".into(),
            headers: BTreeMap::new(),
        }
    }
}

impl RouteConfig {
    /// The columns the route reads from every row (for preflight's table check).
    pub fn columns(&self) -> Vec<String> {
        let mut wanted = vec![
            self.by.clone(),
            self.key.clone(),
            self.payload.clone(),
            self.id.clone(),
        ];
        wanted.extend(self.headers.values().cloned());
        wanted
    }
}

/// A record ready to produce.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub topic: String,
    pub key: Option<Vec<u8>>,
    /// `None` is a tombstone (NULL payload).
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, Option<Vec<u8>>)>,
}

impl Record {
    /// Approximate size on the wire, compared with the producer's `message.max.bytes`.
    pub fn size(&self) -> usize {
        self.key.as_ref().map_or(0, Vec::len)
            + self.value.as_ref().map_or(0, Vec::len)
            + self
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.as_ref().map_or(0, Vec::len))
                .sum::<usize>()
    }
}

/// Why a row cannot be routed. `reason` is a stable label; `detail` names the column and value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unroutable {
    pub reason: &'static str,
    pub detail: String,
}

/// Header carrying the source position of the row's transaction.
pub const POSITION_HEADER: &str = "outboxd.position";
/// Header carrying the outbox row id (Debezium's name).
pub const ID_HEADER: &str = "id";

pub struct Router {
    config: RouteConfig,
    max_message_bytes: usize,
}

impl Router {
    /// `max_message_bytes` is the producer's `message.max.bytes`; larger records are unroutable.
    pub fn new(config: RouteConfig, max_message_bytes: usize) -> Self {
        Router {
            config,
            max_message_bytes,
        }
    }

    pub fn route(&self, row: &Row) -> Result<Record, Unroutable> {
        let c = &self.config;
        let by = text(row, &c.by)?.ok_or_else(|| Unroutable {
            reason: "null_routing_value",
            detail: format!("column {} is NULL, so there is no topic for the row", c.by),
        })?;
        let topic = c.topic.replace("${routedByValue}", &by);
        validate_topic_name(&topic).map_err(|why| Unroutable {
            reason: "invalid_topic",
            detail: format!("topic {topic:?} (from column {} = {by:?}): {why}", c.by),
        })?;
        let key = text(row, &c.key)?.map(String::into_bytes);
        let value = match column(row, &c.payload)? {
            Value::BadText { charset, .. } => {
                return Err(Unroutable {
                    reason: "invalid_text",
                    detail: format!("column {} is not valid {charset}", c.payload),
                })
            }
            v => v.to_bytes(),
        };
        let id = text(row, &c.id)?.ok_or_else(|| Unroutable {
            reason: "null_id",
            detail: format!("column {} (the event id) is NULL", c.id),
        })?;
        let mut headers = Vec::with_capacity(2 + c.headers.len());
        headers.push((ID_HEADER.to_string(), Some(id.into_bytes())));
        for (header, col) in &c.headers {
            headers.push((header.clone(), text(row, col)?.map(String::into_bytes)));
        }
        headers.push((
            POSITION_HEADER.to_string(),
            Some(row.origin.as_bytes().to_vec()),
        ));
        let record = Record {
            topic,
            key,
            value,
            headers,
        };
        if record.size() > self.max_message_bytes {
            return Err(Unroutable {
                reason: "too_large",
                detail: format!(
                    "record of {} bytes exceeds the producer's message.max.bytes ({})",
                    record.size(),
                    self.max_message_bytes
                ),
            });
        }
        Ok(record)
    }
}

impl Router {
    /// The dead-letter record for `row`: the row as JSON, with `outboxd.error`, `outboxd.position` and
    /// `outboxd.table` headers. It must fit where the row did not: values too big for the producer's
    /// limit are replaced by their size, so a record too large for Kafka cannot loop forever.
    pub fn dead_letter(&self, row: &Row, why: &Unroutable, topic: &str) -> Record {
        let budget = self.max_message_bytes / 2;
        let mut body: serde_json::Map<String, serde_json::Value> = row
            .names
            .iter()
            .zip(&row.values)
            .map(|(n, v)| (n.to_string(), v.to_json()))
            .collect();
        if serde_json::to_vec(&body).map_or(0, |b| b.len()) > budget {
            for value in body.values_mut() {
                if let serde_json::Value::String(s) = value {
                    if s.len() > 1024 {
                        *value = serde_json::json!({ "omitted_bytes": s.len() });
                    }
                }
            }
        }
        let mut error = format!("{}: {}", why.reason, why.detail);
        if error.len() > 2048 {
            let cut = (0..=2048)
                .rev()
                .find(|i| error.is_char_boundary(*i))
                .unwrap_or(0);
            error.truncate(cut);
        }
        Record {
            topic: topic.to_string(),
            key: None,
            value: Some(serde_json::Value::Object(body).to_string().into_bytes()),
            headers: vec![
                ("outboxd.error".into(), Some(error.into_bytes())),
                (
                    "outboxd.position".into(),
                    Some(row.origin.as_bytes().to_vec()),
                ),
                ("outboxd.table".into(), Some(row.table.as_bytes().to_vec())),
            ],
        }
    }
}

fn column<'r>(row: &'r Row, name: &str) -> Result<&'r Value, Unroutable> {
    row.get(name).ok_or_else(|| Unroutable {
        reason: "missing_column",
        detail: format!("table {} has no column {name}", row.table),
    })
}

/// The column rendered as text; `None` for NULL.
fn text(row: &Row, name: &str) -> Result<Option<String>, Unroutable> {
    match column(row, name)? {
        Value::Null => Ok(None),
        Value::BadText { charset, .. } => Err(Unroutable {
            reason: "invalid_text",
            detail: format!("column {name} is not valid {charset}"),
        }),
        v => Ok(v.render()),
    }
}

/// Kafka's rules: 1..=249 characters from `[a-zA-Z0-9._-]`, not `.` or `..`.
pub fn validate_topic_name(topic: &str) -> Result<(), String> {
    if topic.is_empty() {
        return Err("empty topic name".into());
    }
    if topic.len() > 249 {
        return Err(format!("{} characters, more than Kafka's 249", topic.len()));
    }
    if topic == "." || topic == ".." {
        return Err("'.' and '..' are not topic names".into());
    }
    if let Some(bad) = topic
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "character {bad:?} is not allowed (only a-z, A-Z, 0-9, '.', '_', '-')"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    fn row(cols: &[(&str, Value)]) -> Row {
        Row {
            table: "app.outbox".into(),
            names: cols
                .iter()
                .map(|(n, _)| Arc::from(*n))
                .collect::<Vec<_>>()
                .into(),
            values: cols.iter().map(|(_, v)| v.clone()).collect(),
            origin: "gtid:0-1-7".into(),
        }
    }

    fn debezium_row() -> Vec<(&'static str, Value)> {
        vec![
            ("id", Value::Binary((0u8..16).collect())),
            ("aggregatetype", Value::Text("order".into())),
            ("aggregateid", Value::Text("o-1".into())),
            ("type", Value::Text("OrderCreated".into())),
            ("payload", Value::Json(r#"{"a":1}"#.into())),
        ]
    }

    #[test]
    fn debezium_defaults() {
        let router = Router::new(RouteConfig::default(), 1_000_000);
        let r = router.route(&row(&debezium_row())).unwrap();
        assert_eq!(r.topic, "outbox.event.order");
        assert_eq!(r.key.as_deref(), Some(&b"o-1"[..]));
        assert_eq!(r.value.as_deref(), Some(&br#"{"a":1}"#[..]));
        assert_eq!(
            r.headers,
            vec![
                (
                    "id".to_string(),
                    Some(b"00010203-0405-0607-0809-0a0b0c0d0e0f".to_vec())
                ),
                ("outboxd.position".to_string(), Some(b"gtid:0-1-7".to_vec())),
            ]
        );
    }

    #[test]
    fn custom_route_with_extra_headers_and_tombstone() {
        let config = RouteConfig {
            by: "type".into(),
            topic: "events-${routedByValue}".into(),
            headers: BTreeMap::from([("eventType".to_string(), "type".to_string())]),
            ..RouteConfig::default()
        };
        let mut cols = debezium_row();
        cols[4].1 = Value::Null;
        cols[2].1 = Value::Null;
        let r = Router::new(config, 1_000_000).route(&row(&cols)).unwrap();
        assert_eq!(r.topic, "events-OrderCreated");
        assert_eq!(r.key, None);
        assert_eq!(r.value, None);
        assert!(r
            .headers
            .contains(&("eventType".to_string(), Some(b"OrderCreated".to_vec()))));
    }

    #[test]
    fn unroutable_reasons() {
        let router = Router::new(RouteConfig::default(), 100);
        let reason = |cols: Vec<(&str, Value)>| router.route(&row(&cols)).unwrap_err().reason;
        let mut c = debezium_row();
        c.remove(1);
        assert_eq!(reason(c), "missing_column");
        let mut c = debezium_row();
        c[1].1 = Value::Null;
        assert_eq!(reason(c), "null_routing_value");
        let mut c = debezium_row();
        c[1].1 = Value::Text("a b".into());
        assert_eq!(reason(c), "invalid_topic");
        let mut c = debezium_row();
        c[4].1 = Value::BadText {
            bytes: vec![0xff],
            charset: "utf8mb4".into(),
        };
        assert_eq!(reason(c), "invalid_text");
        let mut c = debezium_row();
        c[4].1 = Value::Text("x".repeat(200));
        assert_eq!(reason(c), "too_large");
        let mut c = debezium_row();
        c[0].1 = Value::Null;
        assert_eq!(reason(c), "null_id");
    }

    #[test]
    fn a_dead_letter_for_a_too_large_row_fits_the_limit() {
        let router = Router::new(RouteConfig::default(), 10_000);
        let mut cols = debezium_row();
        cols[4].1 = Value::Text("x".repeat(50_000));
        let row = row(&cols);
        let why = router.route(&row).unwrap_err();
        assert_eq!(why.reason, "too_large");
        let dead = router.dead_letter(&row, &why, "dlq");
        assert!(dead.size() < 10_000, "{}", dead.size());
        let body: serde_json::Value = serde_json::from_slice(dead.value.as_ref().unwrap()).unwrap();
        assert_eq!(body["payload"]["omitted_bytes"], 50_000);
        assert_eq!(body["aggregatetype"], "order");
    }

    #[test]
    fn topic_names() {
        assert!(validate_topic_name("outbox.event.order_1-x").is_ok());
        assert!(validate_topic_name("..").is_err());
        assert!(validate_topic_name(&"a".repeat(250)).is_err());
        assert!(validate_topic_name("ordér").is_err());
    }
}
