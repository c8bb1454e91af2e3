//! The router: a pure function from an outbox row to a Kafka record. No I/O.
//!
//! Defaults follow Debezium's Outbox Event Router so a consumer written for Debezium reads outboxd's
//! records unchanged: topic `outbox.event.${routedByValue}` from `aggregatetype`, key `aggregateid`,
//! value `payload` as stored, header `id`. outboxd adds the header `outboxd.position` (where the row's
//! transaction starts in the source log). A row that cannot become a valid record is [`Unroutable`]
//! with a reason that labels the dead-letter metric.
//!
//! The Outbox Event Router's options have equivalents here (Debezium's names in README "Switching
//! from Debezium"): a topic from a regular expression over the routing value, extra columns placed
//! as headers, in an envelope around the payload or as the partition, the record timestamp from a
//! column (default: the source transaction's commit time), tombstones for empty payloads, and W3C
//! trace context ([`trace`]).

mod timestamp;
mod trace;

use std::collections::BTreeMap;

use regex::Regex;

use crate::source::{Row, Value};

/// How a row becomes a Kafka record. Defaults are those of Debezium's Outbox Event Router.
#[derive(Debug, Clone, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RouteConfig {
    /// The column whose value is `${routedByValue}` in `topic` (Debezium `route.by.field`).
    pub by: String,
    /// The topic: a template (`${routedByValue}`), or with `topic_regex` the replacement (`$1`,
    /// `${name}`).
    pub topic: String,
    /// A regular expression the whole routing value must match; its groups feed `topic`.
    pub topic_regex: Option<String>,
    /// The column that becomes the record key (Debezium `table.field.event.key`); NULL: no key.
    /// Records of one key keep their commit order.
    pub key: String,
    /// The column that becomes the record value, bytes as stored (Debezium
    /// `table.field.event.payload`); NULL: a tombstone.
    pub payload: String,
    /// The column that becomes the `id` header (Debezium `table.field.event.id`), which consumers
    /// de-duplicate by; a BINARY(16) id is written as `binary_16` says.
    pub id: String,
    /// More headers from columns: `{ eventType = "type" }` puts column `type` in header `eventType`.
    pub headers: BTreeMap<String, String>,
    /// Column holding the record timestamp; default the source transaction's commit time.
    pub timestamp: Option<String>,
    /// Extra columns placed in the record.
    pub additional: Vec<Additional>,
    /// What an `additional` column missing from a row does.
    pub missing: Missing,
    /// An empty (or all-whitespace) payload becomes a tombstone, as a NULL one does (in an
    /// envelope, where a NULL payload is otherwise a `null` field, both).
    pub tombstone_on_empty_payload: bool,
    /// In an envelope, a JSON payload is embedded as JSON (Debezium `table.expand.json.payload`);
    /// by default it is a string there, as Debezium writes it.
    pub expand_json_payload: bool,
    /// Debezium's `tracing.span.context.field`: W3C trace context in Java properties text.
    pub tracing_span_context: String,
    /// What an UPDATE or DELETE of an outbox row does (Debezium `table.op.invalid.behavior`).
    pub on_update_delete: OnUpdateDelete,
    /// How 16-byte binary columns (BINARY(16) ids and keys) become header, key and topic text.
    pub binary_16: Binary16,
}

/// 16-byte binaries as text: a UUID, or base64 as Debezium writes every binary column by default
/// (`binary.handling.mode=bytes` through the `SimpleHeaderConverter`). Other binaries are always
/// base64.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Deserialize,
    serde::Serialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Binary16 {
    /// Canonical UUID text (`00010203-0405-…`).
    #[default]
    Uuid,
    /// Base64 (`AAECAwQFBgcICQoLDA0ODw==`), byte-for-byte what Debezium wrote.
    Base64,
}

/// UPDATEs of outbox rows are never forwarded; this says how loudly (DELETEs, the usual cleanup, are
/// only counted). MySQL/MariaDB: Postgres publications made by outboxd publish inserts only, so
/// updates never reach it there.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Deserialize,
    serde::Serialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum OnUpdateDelete {
    /// Counted (`outboxd_ignored_events_total`) and logged as a warning.
    #[default]
    Warn,
    /// Counted and logged as an error.
    Error,
    /// Stops outboxd: the application is not supposed to change outbox rows.
    Fatal,
}

impl Default for RouteConfig {
    fn default() -> Self {
        RouteConfig {
            by: "aggregatetype".into(),
            topic: "outbox.event.${routedByValue}".into(),
            topic_regex: None,
            key: "aggregateid".into(),
            payload: "payload".into(),
            id: "id".into(),
            headers: BTreeMap::new(),
            timestamp: None,
            additional: Vec::new(),
            missing: Missing::Error,
            tombstone_on_empty_payload: false,
            expand_json_payload: false,
            tracing_span_context: "tracingspancontext".into(),
            on_update_delete: OnUpdateDelete::Warn,
            binary_16: Binary16::Uuid,
        }
    }
}

/// One extra column and where it goes (Debezium `table.fields.additional.placement`).
#[derive(Debug, Clone, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Additional {
    /// The outbox column.
    pub column: String,
    /// Where its value goes.
    pub placement: Placement,
    /// The header or envelope field name; default the column's name.
    #[serde(rename = "as", default)]
    pub name: Option<String>,
}

impl Additional {
    fn name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.column)
    }
}

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// A header named `as`.
    Header,
    /// A field of the value, which becomes `{"payload": …, "<as>": …}`.
    Envelope,
    /// The record's partition (a non-negative integer column).
    Partition,
}

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Missing {
    /// The row is unroutable (dead-lettered or stopping outboxd).
    Error,
    /// The placement is skipped for that row.
    Ignore,
}

impl RouteConfig {
    /// The names of the headers the route writes from columns (`route.headers`, and
    /// `route.additional` entries placed as headers).
    pub fn header_names(&self) -> impl Iterator<Item = &str> {
        self.headers.keys().map(String::as_str).chain(
            self.additional
                .iter()
                .filter(|a| a.placement == Placement::Header)
                .map(Additional::name),
        )
    }

    /// Whether `topic` (an existing one) is a topic this route can send events to: the template's
    /// text around `${routedByValue}`, or the fixed topic. With `topic_regex` the replacement can
    /// name anything, so no existing topic is claimed (their grants go unchecked).
    pub fn may_name(&self, topic: &str) -> bool {
        if self.topic_regex.is_some() {
            return false;
        }
        match self.topic.split_once("${routedByValue}") {
            Some((prefix, suffix)) => {
                topic.len() > prefix.len() + suffix.len()
                    && topic.starts_with(prefix)
                    && topic.ends_with(suffix)
            }
            None => topic == self.topic,
        }
    }

    /// The one topic every event goes to, when the route names no other.
    pub fn fixed_topic(&self) -> Option<&str> {
        (self.topic_regex.is_none() && !self.topic.contains("${routedByValue}"))
            .then_some(self.topic.as_str())
    }

    /// The columns the route reads from every row (for preflight's table check).
    pub fn columns(&self) -> Vec<String> {
        let mut wanted = vec![
            self.by.clone(),
            self.key.clone(),
            self.payload.clone(),
            self.id.clone(),
        ];
        wanted.extend(self.headers.values().cloned());
        wanted.extend(self.timestamp.clone());
        if self.missing == Missing::Error {
            wanted.extend(self.additional.iter().map(|a| a.column.clone()));
        }
        wanted
    }

    /// Checks what serde cannot; `Err((key, why, fix))`.
    pub fn validate(&self) -> Result<(), (String, String, String)> {
        let bad = |key: &str, why: String, fix: &str| Err((key.to_string(), why, fix.to_string()));
        match &self.topic_regex {
            None => {
                if !self.topic.contains("${routedByValue}") && self.topic.contains("${") {
                    return bad(
                        "route.topic",
                        format!("{:?} has an unknown placeholder", self.topic),
                        "the only placeholder is ${routedByValue} (or set route.topic_regex and use its groups)",
                    );
                }
            }
            Some(pattern) => {
                let regex = compile(pattern).map_err(|e| {
                    (
                        "route.topic_regex".to_string(),
                        format!("{pattern:?} is not a regular expression: {e}"),
                        "use Rust regex syntax (named groups are (?<name>…) or (?P<name>…))"
                            .to_string(),
                    )
                })?;
                for group in placeholders(&self.topic) {
                    let known = group
                        .parse::<usize>()
                        .is_ok_and(|n| n < regex.captures_len())
                        || regex.capture_names().flatten().any(|n| n == group);
                    if !known {
                        return bad(
                            "route.topic",
                            format!("{:?} refers to ${{{group}}}, which route.topic_regex does not capture", self.topic),
                            "use the regex's group numbers ($1) or names (${name})",
                        );
                    }
                }
            }
        }
        if self.topic_regex.is_none()
            && placeholders(&self.topic)
                .iter()
                .any(|p| p != "routedByValue")
        {
            return bad(
                "route.topic",
                format!(
                    "{:?} refers to a group, but route.topic_regex is not set",
                    self.topic
                ),
                "set route.topic_regex, or use only ${routedByValue}",
            );
        }
        let mut headers: Vec<&str> = self.headers.keys().map(String::as_str).collect();
        let mut fields: Vec<&str> = Vec::new();
        for a in &self.additional {
            let names = match a.placement {
                Placement::Header => &mut headers,
                Placement::Envelope => &mut fields,
                Placement::Partition => continue,
            };
            if names.contains(&a.name()) {
                return bad(
                    "route.additional",
                    format!(
                        "{:?} is placed twice in the {}",
                        a.name(),
                        if a.placement == Placement::Header {
                            "headers"
                        } else {
                            "envelope"
                        }
                    ),
                    "give each a distinct name with `as`",
                );
            }
            names.push(a.name());
        }
        let mut partitions = 0;
        for a in &self.additional {
            if a.column.is_empty() {
                return bad(
                    "route.additional",
                    "an entry without a column".into(),
                    "name a column of the outbox table",
                );
            }
            match a.placement {
                Placement::Header if a.name() == ID_HEADER || a.name().starts_with("outboxd.") => {
                    return bad(
                        "route.additional",
                        format!("header {} is outboxd's own", a.name()),
                        "pick another name with `as`",
                    )
                }
                Placement::Envelope if a.name() == "payload" => {
                    return bad(
                        "route.additional",
                        "envelope field `payload` holds the payload itself".into(),
                        "pick another name with `as`",
                    )
                }
                Placement::Partition => partitions += 1,
                _ => {}
            }
        }
        if partitions > 1 {
            return bad(
                "route.additional",
                "more than one column is placed as the partition".into(),
                "keep one",
            );
        }
        Ok(())
    }
}

/// The whole value must match, as Debezium's `route.topic.regex` does.
fn compile(pattern: &str) -> Result<Regex, regex::Error> {
    Regex::new(&format!("^(?:{pattern})$"))
}

/// The `$name` / `${name}` references of a replacement.
fn placeholders(template: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(at) = rest.find('$') {
        rest = &rest[at + 1..];
        if let Some(inner) = rest.strip_prefix('{') {
            if let Some(end) = inner.find('}') {
                out.push(inner[..end].to_string());
                rest = &inner[end + 1..];
            }
        } else {
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            if end > 0 {
                out.push(rest[..end].to_string());
            }
            rest = &rest[end..];
        }
    }
    out
}

/// A record ready to produce.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub topic: String,
    pub key: Option<Vec<u8>>,
    /// `None` is a tombstone (NULL payload).
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// Milliseconds since the Unix epoch; `None` leaves it to the producer.
    pub timestamp: Option<i64>,
    /// A fixed partition (an `additional` placement); `None` lets the partitioner choose.
    pub partition: Option<i32>,
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
/// Which row a record is when its row id cannot say (a dead letter, a row whose id is empty):
/// [`row_identity`]. The sinks that de-duplicate by an id (NATS's `Nats-Msg-Id`, SQS/SNS FIFO's
/// de-duplication id) name such a record by it.
pub const ROW_HEADER: &str = "outboxd.row";
/// A router-made dead letter's header naming the row's table.
pub const TABLE_HEADER: &str = "outboxd.table";

/// A row's identity, the same on every resend: `<pipeline>/<outboxd.position>#<n>` for the n-th
/// row (from 0) of its transaction (resends replay whole transactions, in order). The pipeline's
/// name keeps two pipelines sharing a dead-letter stream or queue apart (their servers may write
/// the same positions). A snapshot row's position already names the row by its primary key (its
/// place in a chunk may differ when a snapshot resumes), so it has no `#<n>`.
pub fn row_identity(pipeline: &str, row: &Row, index: u32) -> String {
    if crate::source::snapshot::is_snapshot_origin(&row.origin) {
        format!("{pipeline}/{}", row.origin)
    } else {
        format!("{pipeline}/{}#{index}", row.origin)
    }
}

/// Whether `record`'s row id is missing or empty (it cannot name the record for de-duplication).
pub fn lacks_row_id(record: &Record) -> bool {
    record
        .headers
        .iter()
        .find(|(name, _)| name == ID_HEADER)
        .and_then(|(_, value)| value.as_deref())
        .is_none_or(<[u8]>::is_empty)
}
/// Header carrying the outbox row id (Debezium's name).
pub const ID_HEADER: &str = "id";

pub struct Router {
    config: RouteConfig,
    topic_regex: Option<Regex>,
    max_message_bytes: usize,
    /// The most bytes of key and headers a record may carry (RabbitMQ: one AMQP frame).
    max_header_bytes: usize,
    /// The last routing value and the valid topic it gave: outboxes mostly route runs of rows to
    /// one topic, and this spares each of them the substitution and the name check.
    last_topic: std::sync::Mutex<Option<(String, String)>>,
}

impl Router {
    /// `max_message_bytes` is the producer's `message.max.bytes`; larger records are unroutable.
    /// `config` passed [`RouteConfig::validate`] (Config::validate calls it).
    pub fn new(config: RouteConfig, max_message_bytes: usize) -> Self {
        let topic_regex = config
            .topic_regex
            .as_deref()
            .map(|p| compile(p).expect("route.topic_regex was validated with the config"));
        Router {
            config,
            topic_regex,
            max_message_bytes,
            max_header_bytes: usize::MAX,
            last_topic: std::sync::Mutex::new(None),
        }
    }

    /// Records whose key and headers take more than `bytes` are unroutable (`too_large`).
    pub fn with_max_header_bytes(mut self, bytes: usize) -> Self {
        self.max_header_bytes = bytes;
        self
    }

    /// The topic for routing value `by`, checked against Kafka's naming rules.
    fn topic(&self, by: &str) -> Result<String, Unroutable> {
        let c = &self.config;
        let mut last = self.last_topic.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((value, topic)) = last.as_ref() {
            if value == by {
                return Ok(topic.clone());
            }
        }
        let topic = match &self.topic_regex {
            None => c.topic.replace("${routedByValue}", by),
            Some(regex) => {
                if !regex.is_match(by) {
                    return Err(Unroutable {
                        reason: "topic_regex_mismatch",
                        detail: format!(
                            "column {} = {by:?} does not match route.topic_regex {:?}",
                            c.by,
                            c.topic_regex.as_deref().unwrap_or_default()
                        ),
                    });
                }
                regex.replace(by, c.topic.as_str()).into_owned()
            }
        };
        validate_topic_name(&topic).map_err(|why| Unroutable {
            reason: "invalid_topic",
            detail: format!("topic {topic:?} (from column {} = {by:?}): {why}", c.by),
        })?;
        *last = Some((by.to_string(), topic.clone()));
        Ok(topic)
    }

    /// The time `route.timestamp`'s column holds for `row`, if it holds a valid one (`outboxd
    /// audit`'s window, for rows the router refuses too).
    pub fn column_timestamp(&self, row: &Row) -> Option<i64> {
        let col = self.config.timestamp.as_ref()?;
        timestamp::millis(column(row, col).ok()?).ok().flatten()
    }

    pub fn route(&self, row: &Row) -> Result<Record, Unroutable> {
        let c = &self.config;
        // UUID text always: base64's `+`, `/` and `=` are not valid in topic names.
        let by = text(row, &c.by, Binary16::Uuid)?.ok_or_else(|| Unroutable {
            reason: "null_routing_value",
            detail: format!("column {} is NULL, so there is no topic for the row", c.by),
        })?;
        let topic = self.topic(&by)?;
        let key = text(row, &c.key, c.binary_16)?.map(String::into_bytes);
        let payload = column(row, &c.payload)?;
        if let Value::BadText { charset, .. } = payload {
            return Err(Unroutable {
                reason: "invalid_text",
                detail: format!("column {} is not valid {charset}", c.payload),
            });
        }
        let mut value = payload.to_bytes();
        // Text that is empty or only whitespace (Debezium's rule); binary only when empty.
        let textual = matches!(payload, Value::Text(_) | Value::Json(_));
        if c.tombstone_on_empty_payload
            && value
                .as_ref()
                .is_some_and(|v| v.is_empty() || (textual && v.iter().all(u8::is_ascii_whitespace)))
        {
            value = None;
        }
        let id = text(row, &c.id, c.binary_16)?.ok_or_else(|| Unroutable {
            reason: "null_id",
            detail: format!("column {} (the event id) is NULL", c.id),
        })?;
        let mut headers = Vec::with_capacity(3 + c.headers.len() + c.additional.len());
        headers.push((ID_HEADER.to_string(), Some(id.into_bytes())));
        for (header, col) in &c.headers {
            headers.push((
                header.clone(),
                text(row, col, c.binary_16)?.map(String::into_bytes),
            ));
        }
        // Envelope fields as JSON text, in the configured order.
        let mut envelope: Option<Vec<(&str, String)>> = None;
        let mut partition = None;
        for extra in &c.additional {
            let Some(v) = row.get(&extra.column) else {
                if c.missing == Missing::Ignore {
                    continue;
                }
                return Err(Unroutable {
                    reason: "missing_column",
                    detail: format!(
                        "table {} has no column {} (route.additional; set route.missing = \"ignore\" to skip it)",
                        row.table, extra.column
                    ),
                });
            };
            match extra.placement {
                Placement::Header => headers.push((
                    extra.name().to_string(),
                    text(row, &extra.column, c.binary_16)?.map(String::into_bytes),
                )),
                Placement::Envelope => envelope
                    .get_or_insert_with(Vec::new)
                    .push((extra.name(), json_text(v, true, c.binary_16))),
                Placement::Partition => {
                    partition = Some(partition_of(v).map_err(|why| Unroutable {
                        reason: "invalid_partition",
                        detail: format!("column {}: {why}", extra.column),
                    })?)
                }
            }
        }
        // Debezium 3.5's Event Router (tests/beside_debezium.rs): with envelope fields a NULL
        // payload is `{"payload":null,…}`, not a tombstone; only `tombstone_on_empty_payload`
        // makes one there.
        let tombstone = value.is_none() && c.tombstone_on_empty_payload;
        if let (Some(fields), false) = (envelope, tombstone) {
            let mut text = String::from("{\"payload\":");
            text.push_str(&json_text(payload, c.expand_json_payload, c.binary_16));
            for (name, field) in fields {
                text.push(',');
                text.push_str(&serde_json::Value::from(name).to_string());
                text.push(':');
                text.push_str(&field);
            }
            text.push('}');
            value = Some(text.into_bytes());
        }
        // A configured traceparent/tracestate header wins over the trace context columns.
        if !headers
            .iter()
            .any(|(h, _)| h == trace::TRACEPARENT || h == trace::TRACESTATE)
        {
            let (traceparent, tracestate) = trace::context(row, &c.tracing_span_context);
            for (name, value) in [
                (trace::TRACEPARENT, traceparent),
                (trace::TRACESTATE, tracestate),
            ] {
                if let Some(value) = value {
                    headers.push((name.to_string(), Some(value.into_bytes())));
                }
            }
        }
        headers.push((
            POSITION_HEADER.to_string(),
            Some(row.origin.as_bytes().to_vec()),
        ));
        // A NULL (or zero-date) column falls back to the commit time, as Debezium falls back to its
        // default.
        let timestamp = match &c.timestamp {
            Some(col) => timestamp::millis(column(row, col)?)
                .map_err(|why| Unroutable {
                    reason: "invalid_timestamp",
                    detail: format!("column {col}: {why}"),
                })?
                .or(row.committed_ms),
            None => row.committed_ms,
        };
        let record = Record {
            topic,
            key,
            value,
            headers,
            timestamp,
            partition,
        };
        let header_bytes = record.key.as_ref().map_or(0, Vec::len)
            + record
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.as_ref().map_or(0, Vec::len))
                .sum::<usize>();
        if header_bytes > self.max_header_bytes {
            return Err(Unroutable {
                reason: "too_large",
                detail: format!(
                    "the record's key and headers take {header_bytes} bytes, more than the {} the sink carries in a message's properties",
                    self.max_header_bytes
                ),
            });
        }
        if record.size() > self.max_message_bytes {
            return Err(Unroutable {
                reason: "too_large",
                detail: format!(
                    "record of {} bytes exceeds the largest message outboxd sends ({}: kafka.properties \"message.max.bytes\", rabbitmq.max_message_bytes)",
                    record.size(),
                    self.max_message_bytes
                ),
            });
        }
        Ok(record)
    }
}

impl Router {
    /// The dead-letter record for `row` (whose [`row_identity`] is `identity`): the row as JSON,
    /// with `outboxd.error`, `outboxd.position`, `outboxd.row` and `outboxd.table` headers. It must fit where the row did not: values too big for the producer's
    /// limit are replaced by their size, so a record too large for Kafka cannot loop forever.
    pub fn dead_letter(&self, row: &Row, identity: &str, why: &Unroutable, topic: &str) -> Record {
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
                (POSITION_HEADER.into(), Some(row.origin.as_bytes().to_vec())),
                (ROW_HEADER.into(), Some(identity.as_bytes().to_vec())),
                (TABLE_HEADER.into(), Some(row.table.as_bytes().to_vec())),
            ],
            timestamp: row.committed_ms,
            partition: None,
        }
    }
}

/// A column as JSON text inside an envelope. A JSON column is embedded verbatim (not re-encoded:
/// big numbers, key order and duplicate keys stay as stored) when `expand` is set and it is valid
/// JSON, and as a string otherwise; other values as [`Value::to_json`].
fn json_text(v: &Value, expand: bool, binary_16: Binary16) -> String {
    match v {
        Value::Json(text)
            if expand && serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok() =>
        {
            text.clone()
        }
        Value::Json(text) => serde_json::Value::from(text.as_str()).to_string(),
        Value::Binary(_) => {
            serde_json::Value::from(v.render_as(binary_16 == Binary16::Uuid)).to_string()
        }
        other => other.to_json().to_string(),
    }
}

fn partition_of(v: &Value) -> Result<i32, String> {
    let n = match v {
        Value::Int(n) => *n,
        Value::UInt(n) => i64::try_from(*n).unwrap_or(i64::MAX),
        Value::Text(s) | Value::Decimal(s) => s
            .trim()
            .parse::<i64>()
            .map_err(|_| format!("{s:?} is not a partition number"))?,
        Value::Null => return Err("NULL is not a partition number".into()),
        other => {
            return Err(format!(
                "{} is not a partition number",
                other.render().unwrap_or_default()
            ))
        }
    };
    i32::try_from(n)
        .ok()
        .filter(|p| *p >= 0)
        .ok_or_else(|| format!("{n} is not a partition number"))
}

fn column<'r>(row: &'r Row, name: &str) -> Result<&'r Value, Unroutable> {
    row.get(name).ok_or_else(|| Unroutable {
        reason: "missing_column",
        detail: format!("table {} has no column {name}", row.table),
    })
}

/// The column rendered as text; `None` for NULL.
fn text(row: &Row, name: &str, binary_16: Binary16) -> Result<Option<String>, Unroutable> {
    match column(row, name)? {
        Value::Null => Ok(None),
        Value::BadText { charset, .. } => Err(Unroutable {
            reason: "invalid_text",
            detail: format!("column {name} is not valid {charset}"),
        }),
        v => Ok(v.render_as(binary_16 == Binary16::Uuid)),
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
            committed_ms: Some(1_700_000_000_000),
        }
    }

    #[test]
    fn may_name_claims_the_topics_around_the_routing_value_only() {
        let route = RouteConfig::default();
        assert!(route.may_name("outbox.event.order"));
        assert!(!route.may_name("outbox.event."));
        assert!(!route.may_name("outboxd.dlq"));
        let fixed = RouteConfig {
            topic: "events".into(),
            ..RouteConfig::default()
        };
        assert!(fixed.may_name("events") && !fixed.may_name("events2"));
        assert_eq!(
            (fixed.fixed_topic(), route.fixed_topic()),
            (Some("events"), None)
        );
        let suffixed = RouteConfig {
            topic: "app.${routedByValue}.v1".into(),
            ..RouteConfig::default()
        };
        assert!(suffixed.may_name("app.order.v1") && !suffixed.may_name("app.order.v2"));
        let regex = RouteConfig {
            topic_regex: Some("(.*)".into()),
            topic: "$1".into(),
            ..RouteConfig::default()
        };
        assert!(!regex.may_name("anything"));
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
    fn an_envelope_null_payload_is_a_null_field_unless_empty_payloads_are_tombstones() {
        let envelope = |tombstone_on_empty_payload| {
            Router::new(
                RouteConfig {
                    additional: vec![Additional {
                        column: "type".into(),
                        placement: Placement::Envelope,
                        name: None,
                    }],
                    tombstone_on_empty_payload,
                    ..RouteConfig::default()
                },
                1_000_000,
            )
        };
        let mut columns = debezium_row();
        columns[4].1 = Value::Null;
        assert_eq!(
            envelope(false)
                .route(&row(&columns))
                .unwrap()
                .value
                .as_deref(),
            Some(&br#"{"payload":null,"type":"OrderCreated"}"#[..])
        );
        assert_eq!(envelope(true).route(&row(&columns)).unwrap().value, None);
        columns[4].1 = Value::Text("  ".into());
        assert_eq!(envelope(true).route(&row(&columns)).unwrap().value, None);
    }

    #[test]
    fn binary_16_base64_writes_binary_ids_and_keys_as_debezium_does() {
        let router = Router::new(
            RouteConfig {
                binary_16: Binary16::Base64,
                ..RouteConfig::default()
            },
            1_000_000,
        );
        let mut columns = debezium_row();
        columns[2].1 = Value::Binary(vec![0xff; 16]);
        columns[1].1 = Value::Binary(vec![0xff; 16]);
        let r = router.route(&row(&columns)).unwrap();
        assert_eq!(r.key.as_deref(), Some(&b"/////////////////////w=="[..]));
        // The topic keeps UUID text: base64 is no valid topic name.
        assert_eq!(r.topic, "outbox.event.ffffffff-ffff-ffff-ffff-ffffffffffff");
        assert_eq!(
            r.headers[0].1.as_deref(),
            Some(&b"AAECAwQFBgcICQoLDA0ODw=="[..])
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
    fn the_remembered_topic_follows_the_routing_value() {
        let router = Router::new(RouteConfig::default(), 1_000_000);
        let topic = |value: &str| {
            let mut c = debezium_row();
            c[1].1 = Value::Text(value.into());
            router
                .route(&row(&c))
                .map(|r| r.topic)
                .map_err(|e| e.reason)
        };
        assert_eq!(topic("order"), Ok("outbox.event.order".into()));
        assert_eq!(topic("order"), Ok("outbox.event.order".into()));
        assert_eq!(topic("customer"), Ok("outbox.event.customer".into()));
        assert_eq!(topic("a b"), Err("invalid_topic"));
        assert_eq!(topic("customer"), Ok("outbox.event.customer".into()));
        assert_eq!(topic("a b"), Err("invalid_topic"), "never remembered");
        assert_eq!(topic("order"), Ok("outbox.event.order".into()));
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
    fn a_key_and_headers_over_the_sinks_properties_limit_are_too_large() {
        let router = Router::new(RouteConfig::default(), 1_000_000).with_max_header_bytes(300);
        assert!(router.route(&row(&debezium_row())).is_ok());
        let mut c = debezium_row();
        c[2].1 = Value::Text("k".repeat(400));
        let why = router.route(&row(&c)).unwrap_err();
        assert_eq!(why.reason, "too_large");
        assert!(why.detail.contains("key and headers"), "{}", why.detail);
    }

    #[test]
    fn a_row_identity_names_the_pipeline_the_transaction_and_the_place_but_a_snapshot_row_by_its_key(
    ) {
        let mut r = row(&debezium_row());
        r.origin = "gtid:0-1-7".into();
        assert_eq!(row_identity("orders", &r, 2), "orders/gtid:0-1-7#2");
        r.origin = "snapshot:app.outbox:42".into();
        assert_eq!(
            row_identity("orders", &r, 2),
            "orders/snapshot:app.outbox:42"
        );
        let router = Router::new(RouteConfig::default(), 1_000_000);
        assert!(!lacks_row_id(&router.route(&row(&debezium_row())).unwrap()));
        let mut cols = debezium_row();
        cols[0].1 = Value::Text(String::new());
        assert!(lacks_row_id(&router.route(&row(&cols)).unwrap()));
    }

    #[test]
    fn a_dead_letter_for_a_too_large_row_fits_the_limit() {
        let router = Router::new(RouteConfig::default(), 10_000);
        let mut cols = debezium_row();
        cols[4].1 = Value::Text("x".repeat(50_000));
        let row = row(&cols);
        let why = router.route(&row).unwrap_err();
        assert_eq!(why.reason, "too_large");
        let dead = router.dead_letter(&row, "orders/gtid:0-1-7#3", &why, "dlq");
        assert!(dead.size() < 10_000, "{}", dead.size());
        let body: serde_json::Value = serde_json::from_slice(dead.value.as_ref().unwrap()).unwrap();
        assert_eq!(body["payload"]["omitted_bytes"], 50_000);
        assert_eq!(body["aggregatetype"], "order");
    }

    fn with(extra: &[(&'static str, Value)]) -> Row {
        let mut cols = debezium_row();
        cols.extend(extra.iter().cloned());
        row(&cols)
    }

    fn header<'r>(r: &'r Record, name: &str) -> Option<&'r [u8]> {
        r.headers
            .iter()
            .find(|(h, _)| h == name)
            .and_then(|(_, v)| v.as_deref())
    }

    #[test]
    fn a_topic_from_a_regular_expression_over_the_routing_value() {
        let config = RouteConfig {
            by: "type".into(),
            topic_regex: Some(r"Order(Created|Paid)".into()),
            topic: "orders.$1".into(),
            ..RouteConfig::default()
        };
        config.validate().unwrap();
        let router = Router::new(config, 1_000_000);
        assert_eq!(
            router.route(&row(&debezium_row())).unwrap().topic,
            "orders.Created"
        );
        let mut cols = debezium_row();
        cols[3].1 = Value::Text("CustomerCreated".into());
        let why = router.route(&row(&cols)).unwrap_err();
        assert_eq!(why.reason, "topic_regex_mismatch");
        // Named groups, as Debezium writes them; the whole value must match.
        let named = RouteConfig {
            topic_regex: Some(r"(?<routedByValue>ord[a-z]+)".into()),
            topic: "t.${routedByValue}".into(),
            ..RouteConfig::default()
        };
        named.validate().unwrap();
        assert_eq!(
            Router::new(named, 1_000_000)
                .route(&row(&debezium_row()))
                .unwrap()
                .topic,
            "t.order"
        );
        let unknown = RouteConfig {
            topic_regex: Some("(a)".into()),
            topic: "t.$2".into(),
            ..RouteConfig::default()
        };
        assert_eq!(unknown.validate().unwrap_err().0, "route.topic");
        let broken = RouteConfig {
            topic_regex: Some("(".into()),
            ..RouteConfig::default()
        };
        assert_eq!(broken.validate().unwrap_err().0, "route.topic_regex");
    }

    #[test]
    fn additional_columns_go_to_headers_the_envelope_or_the_partition() {
        let config: RouteConfig = toml::from_str(
            r#"
            additional = [
              { column = "type", placement = "header", as = "eventType" },
              { column = "type", placement = "envelope", as = "eventType" },
              { column = "aggregateid", placement = "envelope" },
              { column = "shard", placement = "partition" },
            ]
            "#,
        )
        .unwrap();
        config.validate().unwrap();
        let router = Router::new(config.clone(), 1_000_000);
        let r = router.route(&with(&[("shard", Value::Int(4))])).unwrap();
        assert_eq!(header(&r, "eventType"), Some(&b"OrderCreated"[..]));
        // As Debezium: the JSON payload is a string in the envelope unless expanded.
        assert_eq!(
            std::str::from_utf8(r.value.as_ref().unwrap()).unwrap(),
            r#"{"payload":"{\"a\":1}","eventType":"OrderCreated","aggregateid":"o-1"}"#
        );
        let expanded = Router::new(
            RouteConfig {
                expand_json_payload: true,
                ..config.clone()
            },
            1_000_000,
        );
        let mut cols = debezium_row();
        cols[4].1 = Value::Json(r#"{"big": 12345678901234567890123, "b": 1, "a": 2}"#.into());
        cols.push(("shard", Value::Int(0)));
        let e = expanded.route(&row(&cols)).unwrap();
        assert_eq!(
            std::str::from_utf8(e.value.as_ref().unwrap()).unwrap(),
            r#"{"payload":{"big": 12345678901234567890123, "b": 1, "a": 2},"eventType":"OrderCreated","aggregateid":"o-1"}"#,
            "the payload is embedded as stored"
        );
        // A NULL payload in an envelope is a null field, as Debezium writes it.
        let mut cols = debezium_row();
        cols[4].1 = Value::Null;
        cols.push(("shard", Value::Int(0)));
        assert_eq!(
            router.route(&row(&cols)).unwrap().value.as_deref(),
            Some(&br#"{"payload":null,"eventType":"OrderCreated","aggregateid":"o-1"}"#[..])
        );
        assert_eq!(r.partition, Some(4));
        // A missing column: unroutable by default, skipped with missing = "ignore".
        assert_eq!(
            router.route(&row(&debezium_row())).unwrap_err().reason,
            "missing_column"
        );
        let ignore = RouteConfig {
            missing: Missing::Ignore,
            ..config
        };
        assert_eq!(
            Router::new(ignore, 1_000_000)
                .route(&row(&debezium_row()))
                .unwrap()
                .partition,
            None
        );
        let r = router
            .route(&with(&[("shard", Value::Int(-1))]))
            .unwrap_err();
        assert_eq!(r.reason, "invalid_partition");
        let two: RouteConfig = toml::from_str(
            r#"additional = [{ column = "a", placement = "partition" }, { column = "b", placement = "partition" }]"#,
        )
        .unwrap();
        assert!(two.validate().is_err());
    }

    #[test]
    fn an_empty_payload_is_a_tombstone_only_when_asked() {
        let mut cols = debezium_row();
        cols[4].1 = Value::Text(String::new());
        let plain = Router::new(RouteConfig::default(), 1_000_000);
        assert_eq!(plain.route(&row(&cols)).unwrap().value, Some(Vec::new()));
        let tomb = Router::new(
            RouteConfig {
                tombstone_on_empty_payload: true,
                ..RouteConfig::default()
            },
            1_000_000,
        );
        assert_eq!(tomb.route(&row(&cols)).unwrap().value, None);
        cols[4].1 = Value::Text(" \n".into());
        assert_eq!(tomb.route(&row(&cols)).unwrap().value, None);
    }

    #[test]
    fn the_timestamp_is_the_commit_time_or_a_column() {
        let plain = Router::new(RouteConfig::default(), 1_000_000);
        assert_eq!(
            plain.route(&row(&debezium_row())).unwrap().timestamp,
            Some(1_700_000_000_000)
        );
        let config = RouteConfig {
            timestamp: Some("created_at".into()),
            ..RouteConfig::default()
        };
        assert!(config.columns().contains(&"created_at".to_string()));
        let router = Router::new(config, 1_000_000);
        let r = router
            .route(&with(&[(
                "created_at",
                Value::Temporal("2024-05-01T12:00:00.123000".into()),
            )]))
            .unwrap();
        assert_eq!(r.timestamp, Some(1_714_564_800_123));
        let bad = router
            .route(&with(&[("created_at", Value::Text("soon".into()))]))
            .unwrap_err();
        assert_eq!(bad.reason, "invalid_timestamp");
        // NULL and MySQL's zero date fall back to the commit time.
        for empty in [
            Value::Null,
            Value::Temporal("0000-00-00T00:00:00.000000Z".into()),
        ] {
            let r = router.route(&with(&[("created_at", empty)])).unwrap();
            assert_eq!(r.timestamp, Some(1_700_000_000_000));
        }
        // Seconds (or nonsense) are not taken for milliseconds.
        for n in [0, -5, 1_700_000_000, 1_700_000_000_000_000] {
            let bad = router
                .route(&with(&[("created_at", Value::Int(n))]))
                .unwrap_err();
            assert_eq!(bad.reason, "invalid_timestamp", "{n}");
        }
    }

    #[test]
    fn trace_context_becomes_w3c_headers() {
        let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let router = Router::new(RouteConfig::default(), 1_000_000);
        // Debezium's tracingspancontext column: Java properties text.
        let r = router
            .route(&with(&[(
                "tracingspancontext",
                Value::Text(format!(
                    "#Mon Nov 23 2026\ntracestate=congo\\=t61rcWkgMzE\ntraceparent={parent}\n"
                )),
            )]))
            .unwrap();
        assert_eq!(header(&r, "traceparent"), Some(parent.as_bytes()));
        assert_eq!(header(&r, "tracestate"), Some(&b"congo=t61rcWkgMzE"[..]));
        // Or plain columns.
        let r = router
            .route(&with(&[("traceparent", Value::Text(parent.into()))]))
            .unwrap();
        assert_eq!(header(&r, "traceparent"), Some(parent.as_bytes()));
        assert_eq!(header(&r, "tracestate"), None);
        // Nothing when the row has neither.
        let r = router.route(&row(&debezium_row())).unwrap();
        assert_eq!(header(&r, "traceparent"), None);
    }

    #[test]
    fn topic_names() {
        assert!(validate_topic_name("outbox.event.order_1-x").is_ok());
        assert!(validate_topic_name("..").is_err());
        assert!(validate_topic_name(&"a".repeat(250)).is_err());
        assert!(validate_topic_name("ordér").is_err());
    }
}
