//! A record as SQS and SNS take it: a text body, at most 10 typed attributes, and on FIFO
//! destinations a message group and a de-duplication id. Pure: no client, no I/O.
//!
//! - Body: SQS and SNS take text only (XML characters), never empty. A payload that is not such
//!   text is sent base64-encoded with the attribute `outboxd.body = base64`; a tombstone (NULL
//!   payload) is the body `null` with `outboxd.body = null`, so it cannot be mistaken for the JSON
//!   `null`; an empty payload is the body `-` with `outboxd.body = empty`.
//! - Attributes: the record's headers (`id`, route headers, trace context) as `String`, or `Binary`
//!   when not text; a NULL or empty value is left out (neither service takes an empty one); the key
//!   as `outboxd.key`; outboxd's position (`outboxd.position`) last, when one of the 10 is left
//!   beside the one a dead letter's `outboxd.reason` needs.
//! - FIFO: `MessageGroupId` = the key and `MessageDeduplicationId` = the row id, each as it is when
//!   the service takes it (1–128 of its printable ASCII characters); otherwise `sha256:` and the hex
//!   SHA-256 of its bytes: stable across restarts, so a key keeps one group and a resend keeps its
//!   de-duplication id. Rows without a key share the group `outboxd.no-key`. A dead letter the
//!   router made has no row id: its `outboxd.row` (the transaction's position and the row's place
//!   in it) is its de-duplication id, so a FIFO dead-letter queue keeps each of them.

use super::config::MAX_ATTRIBUTES;
use crate::route::{Record, ID_HEADER, POSITION_HEADER, ROW_HEADER};

/// The attribute naming how the body is encoded (`base64`, `null`, `empty`, `omitted`).
pub const BODY_ATTRIBUTE: &str = "outboxd.body";
/// The attribute holding the record's key.
pub const KEY_ATTRIBUTE: &str = "outboxd.key";
/// On a dead letter: why, and where the row was going.
pub const REASON_ATTRIBUTE: &str = "outboxd.reason";
/// The group of FIFO messages from rows without a key.
pub const NO_KEY_GROUP: &str = "outboxd.no-key";

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Text(String),
    Binary(Vec<u8>),
}

/// One message, ready for a batch entry.
#[derive(Debug, Clone)]
pub struct Message {
    pub body: String,
    pub attributes: Vec<(String, Value)>,
    /// FIFO: the message group (from the key).
    pub group: String,
    /// FIFO: the de-duplication id (from the row id).
    pub dedup: String,
    /// The row id is empty: no de-duplication id to give it on a FIFO destination.
    pub no_id: bool,
}

impl Message {
    pub fn new(record: &Record) -> Message {
        let mut attributes = Vec::with_capacity(record.headers.len() + 2);
        let mut id: &[u8] = &[];
        let mut row: &[u8] = &[];
        let mut position = None;
        for (name, value) in &record.headers {
            if name == POSITION_HEADER {
                position = value.as_deref();
                continue;
            }
            let Some(value) = value.as_deref().filter(|v| !v.is_empty()) else {
                continue;
            };
            if name == ID_HEADER {
                id = value;
            } else if name == ROW_HEADER {
                row = value;
            }
            attributes.push((name.clone(), value_of(value)));
        }
        if let Some(key) = record.key.as_deref().filter(|k| !k.is_empty()) {
            attributes.push((KEY_ATTRIBUTE.to_string(), value_of(key)));
        }
        let body = match record.value.as_deref() {
            None => {
                attributes.push((BODY_ATTRIBUTE.into(), Value::Text("null".into())));
                "null".to_string()
            }
            // Neither service takes an empty body.
            Some([]) => {
                attributes.push((BODY_ATTRIBUTE.into(), Value::Text("empty".into())));
                "-".to_string()
            }
            Some(bytes) => match std::str::from_utf8(bytes) {
                Ok(text) if is_xml_text(text) => text.to_string(),
                _ => {
                    attributes.push((BODY_ATTRIBUTE.into(), Value::Text("base64".into())));
                    use base64::Engine;
                    base64::engine::general_purpose::STANDARD.encode(bytes)
                }
            },
        };
        if let Some(position) = position.filter(|_| attributes.len() + 2 <= MAX_ATTRIBUTES) {
            attributes.push((POSITION_HEADER.to_string(), value_of(position)));
        }
        let group = match record.key.as_deref() {
            Some(key) if !key.is_empty() => fifo_id(key),
            _ => NO_KEY_GROUP.to_string(),
        };
        let dedup = if id.is_empty() { row } else { id };
        Message {
            body,
            attributes,
            group,
            no_id: dedup.is_empty(),
            dedup: fifo_id(dedup),
        }
    }

    /// The size SQS and SNS count against their limit: the body, and each attribute's name, type
    /// and value.
    pub fn size(&self) -> usize {
        self.body.len()
            + self
                .attributes
                .iter()
                .map(|(name, value)| {
                    name.len()
                        + match value {
                            Value::Text(t) => "String".len() + t.len(),
                            Value::Binary(b) => "Binary".len() + b.len(),
                        }
                })
                .sum::<usize>()
    }

    /// This message as a dead letter: `outboxd.reason` says why and where it was going; without
    /// its body when `keep_body` is false (too large), which `outboxd.body = omitted` says.
    pub fn dead_letter(&self, topic: &str, why: &str, keep_body: bool) -> Message {
        let mut copy = self.clone();
        let reason: String = format!("{why} (topic {topic})")
            .chars()
            .take(1024)
            .collect();
        copy.attributes.retain(|(name, _)| name != REASON_ATTRIBUTE);
        copy.attributes
            .push((REASON_ATTRIBUTE.into(), Value::Text(clean_text(&reason))));
        if !keep_body {
            copy.attributes.retain(|(name, _)| name != BODY_ATTRIBUTE);
            copy.attributes
                .push((BODY_ATTRIBUTE.into(), Value::Text("omitted".into())));
            copy.body = "-".into();
        }
        // The position gives way to the reason.
        if copy.attributes.len() > MAX_ATTRIBUTES {
            copy.attributes.retain(|(name, _)| name != POSITION_HEADER);
        }
        copy
    }
}

fn value_of(bytes: &[u8]) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(text) if is_xml_text(text) => Value::Text(text.to_string()),
        _ => Value::Binary(bytes.to_vec()),
    }
}

/// Characters SQS and SNS take in a body or a `String` attribute (XML 1.0's: tab, LF, CR,
/// U+0020–U+D7FF, U+E000–U+FFFD, U+10000 and up).
pub fn is_xml_text(text: &str) -> bool {
    text.chars().all(|c| {
        matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..)
    })
}

fn clean_text(text: &str) -> String {
    text.chars()
        .map(|c| {
            if is_xml_text(c.encode_utf8(&mut [0; 4])) {
                c
            } else {
                '?'
            }
        })
        .collect()
}

/// A FIFO group or de-duplication id for `bytes`: as it is when it is 1–128 printable ASCII
/// characters (what SQS and SNS take), else `sha256:` and its hex SHA-256.
pub fn fifo_id(bytes: &[u8]) -> String {
    // An id that looks like a hashed one is hashed too: it cannot stand for another row's.
    if !bytes.is_empty()
        && bytes.len() <= 128
        && bytes.iter().all(u8::is_ascii_graphic)
        && !bytes.starts_with(b"sha256:")
    {
        return String::from_utf8_lossy(bytes).into_owned();
    }
    let digest = openssl::sha::sha256(bytes);
    let mut id = String::with_capacity(7 + 64);
    id.push_str("sha256:");
    for byte in digest {
        id.push_str(&format!("{byte:02x}"));
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: Option<&[u8]>, value: Option<&[u8]>, id: &str) -> Record {
        Record {
            topic: "orders".into(),
            key: key.map(<[u8]>::to_vec),
            value: value.map(<[u8]>::to_vec),
            headers: vec![
                (ID_HEADER.into(), Some(id.as_bytes().to_vec())),
                ("tenant".into(), None),
                ("blob".into(), Some(vec![0xff, 0x00])),
                (POSITION_HEADER.into(), Some(b"file:4".to_vec())),
            ],
            timestamp: None,
            partition: None,
        }
    }

    #[test]
    fn a_row_without_an_id_is_de_duplicated_by_its_row_identity() {
        let mut r = record(Some(b"k"), Some(b"v"), "");
        assert!(Message::new(&r).no_id, "nothing names it");
        r.headers
            .push((ROW_HEADER.into(), Some(b"orders/file:4#2".to_vec())));
        let m = Message::new(&r);
        assert!(!m.no_id);
        assert_eq!(m.dedup, "orders/file:4#2");
        let dead = m.dead_letter("orders", "unroutable: x", true);
        assert_eq!(dead.dedup, "orders/file:4#2", "a dead letter keeps it");
    }

    #[test]
    fn a_text_payload_is_the_body_and_headers_become_typed_attributes() {
        let m = Message::new(&record(
            Some(b"order-1"),
            Some("{\"é\":1}".as_bytes()),
            "e-1",
        ));
        assert_eq!(m.body, "{\"é\":1}");
        assert_eq!(m.group, "order-1");
        assert_eq!(m.dedup, "e-1");
        assert_eq!(
            m.attributes,
            vec![
                ("id".into(), Value::Text("e-1".into())),
                ("blob".into(), Value::Binary(vec![0xff, 0])),
                (KEY_ATTRIBUTE.into(), Value::Text("order-1".into())),
                (POSITION_HEADER.into(), Value::Text("file:4".into())),
            ],
            "NULL headers are left out"
        );
        assert_eq!(
            m.size(),
            m.body.len() + 2 + 6 + 3 + 4 + 6 + 2 + 11 + 6 + 7 + 16 + 6 + 6
        );
        // With nine attributes already, the position gives way (a dead letter needs one more).
        let mut full = record(Some(b"k"), Some(b"v"), "e-9");
        for h in 0..6 {
            full.headers
                .insert(1, (format!("h{h}"), Some(b"x".to_vec())));
        }
        let m = Message::new(&full);
        assert_eq!(m.attributes.len(), 10 - 1);
        assert!(m.attributes.iter().all(|(n, _)| n != POSITION_HEADER));
    }

    #[test]
    fn binary_payloads_are_base64_and_tombstones_say_so() {
        let m = Message::new(&record(None, Some(&[0, 1, 2]), "e-2"));
        assert_eq!(m.body, "AAEC");
        assert!(m
            .attributes
            .contains(&(BODY_ATTRIBUTE.into(), Value::Text("base64".into()))));
        assert_eq!(m.group, NO_KEY_GROUP);
        let t = Message::new(&record(Some(b"k"), None, "e-3"));
        assert_eq!(t.body, "null");
        assert!(t
            .attributes
            .contains(&(BODY_ATTRIBUTE.into(), Value::Text("null".into()))));
        let empty = Message::new(&record(Some(b"k"), Some(b""), "e-4"));
        assert_eq!(empty.body, "-");
        assert!(empty
            .attributes
            .contains(&(BODY_ATTRIBUTE.into(), Value::Text("empty".into()))));
        let control = Message::new(&record(Some(b"k"), Some(b"a\x01b"), "e-5"));
        assert_eq!(control.body, "YQFi");
    }

    #[test]
    fn ids_the_service_cannot_take_are_hashed_stably() {
        let long = [b'k'; 129];
        for bytes in [&long[..], "ключ".as_bytes(), b"with space", b""] {
            let id = fifo_id(bytes);
            assert!(id.starts_with("sha256:") && id.len() == 71, "{id}");
            assert_eq!(id, fifo_id(bytes));
        }
        assert_ne!(fifo_id("ключ".as_bytes()), fifo_id(b"with space"));
        assert_eq!(fifo_id(b"a!~/"), "a!~/");
        let hashed = fifo_id(b"with space");
        assert_ne!(
            fifo_id(hashed.as_bytes()),
            hashed,
            "a forged hash is hashed again"
        );
    }

    #[test]
    fn a_dead_letter_says_why_and_may_leave_the_body_out() {
        let m = Message::new(&record(Some(b"k"), Some(b"payload"), "e-6"));
        let d = m.dead_letter("orders", "too_large: 300000 bytes", false);
        assert_eq!(d.body, "-");
        assert!(d.attributes.contains(&(
            REASON_ATTRIBUTE.into(),
            Value::Text("too_large: 300000 bytes (topic orders)".into())
        )));
        assert!(d
            .attributes
            .contains(&(BODY_ATTRIBUTE.into(), Value::Text("omitted".into()))));
        let kept = m.dead_letter("orders", "unroutable", true);
        assert_eq!(kept.body, "payload");
    }

    #[test]
    fn a_dead_letter_keeps_to_ten_attributes_and_its_reason_wins_over_the_position() {
        // Eight attributes and the position: the most a message carries.
        let mut full = record(Some(b"k"), Some(b"payload"), "e-7");
        for h in 0..5 {
            full.headers
                .insert(1, (format!("h{h}"), Some(b"x".to_vec())));
        }
        let m = Message::new(&full);
        assert_eq!(m.attributes.len(), 9);
        assert!(m.attributes.iter().any(|(n, _)| n == POSITION_HEADER));
        // Kept body: the reason is the tenth.
        let kept = m.dead_letter("orders", "unroutable", true);
        assert_eq!(kept.attributes.len(), MAX_ATTRIBUTES);
        assert!(kept.attributes.iter().any(|(n, _)| n == POSITION_HEADER));
        // Body left out: the reason and `outboxd.body = omitted` take the position's place.
        let omitted = m.dead_letter("orders", "too_large: 300000 bytes", false);
        assert_eq!(omitted.attributes.len(), MAX_ATTRIBUTES, "{omitted:?}");
        assert!(omitted.attributes.iter().all(|(n, _)| n != POSITION_HEADER));
        for name in [REASON_ATTRIBUTE, BODY_ATTRIBUTE, ID_HEADER, KEY_ATTRIBUTE] {
            assert!(omitted.attributes.iter().any(|(n, _)| n == name), "{name}");
        }
    }
}
