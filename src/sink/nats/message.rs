//! A record as a NATS message: subject, headers and payload (pure; no I/O).
//!
//! NATS headers are text lines, so a value that is not one line of UTF-8 (binary ids or keys, a
//! column holding a line break) cannot go as it is: a line break would end the header early and
//! start another the row chose. Such values are sent base64-encoded and named in the
//! `outboxd.base64` header; everything else goes verbatim. A NULL header column is left out.

use async_nats::header::{HeaderMap, HeaderName, HeaderValue};
use base64::Engine;
use bytes::Bytes;

use crate::route::{Record, ID_HEADER, ROW_HEADER};

/// The header that names a message for JetStream's de-duplication.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";
/// The header that makes the stream store a message only after the one it names
/// (`nats.ordered`).
pub const EXPECTED_LAST_HEADER: &str = "Nats-Expected-Last-Msg-Id";
/// The record's key (NATS has no key of its own).
pub const KEY_HEADER: &str = "outboxd.key";
/// The source commit time, milliseconds since the Unix epoch.
pub const TIMESTAMP_HEADER: &str = "outboxd.timestamp";
/// Comma-separated names of the headers whose values are base64.
pub const BASE64_HEADER: &str = "outboxd.base64";
/// The header of a dead letter naming why it is one (as on every sink).
pub const ERROR_HEADER: &str = "outboxd.error";
/// The header of a dead letter naming the subject it was meant for.
pub const SUBJECT_HEADER: &str = "outboxd.subject";

/// The dead-letter copy of `message`, meant for `subject`, refused for `why`: its headers plus
/// the two that say so, and its payload when `keep_payload` (a message too large for the server
/// goes without it, and so does one whose copy would be too large: at most `max_payload`). A
/// copy that does not fit even then keeps only the id, the key and the two headers.
pub fn dead_letter(
    message: &Message,
    subject: &str,
    why: &str,
    keep_payload: bool,
    max_payload: usize,
) -> Message {
    let mut headers = message.headers.clone();
    let mut why = why.to_string();
    if why.len() > 2048 {
        let cut = (0..=2048)
            .rev()
            .find(|i| why.is_char_boundary(*i))
            .unwrap_or(0);
        why.truncate(cut);
    }
    // An error text is one line (the server's words could hold anything).
    let why = why.replace(['\r', '\n'], " ");
    headers.insert(ERROR_HEADER, why.as_str());
    headers.insert(SUBJECT_HEADER, subject.replace(['\r', '\n'], " ").as_str());
    let mut copy = Message {
        headers,
        payload: if keep_payload {
            message.payload.clone()
        } else {
            Bytes::new()
        },
    };
    if wire_size(&copy) > max_payload {
        copy.payload = Bytes::new();
    }
    if wire_size(&copy) > max_payload {
        let mut headers = HeaderMap::new();
        for name in [MSG_ID_HEADER, ID_HEADER, ERROR_HEADER, SUBJECT_HEADER] {
            if let Some(value) = copy.headers.get(name) {
                headers.insert(name, value.clone());
            }
        }
        copy.headers = headers;
    }
    copy
}

/// A message's size as the server counts it against `max_payload`: the header block and the
/// payload.
pub fn wire_size(message: &Message) -> usize {
    let headers: usize = message
        .headers
        .iter()
        .map(|(name, values)| {
            values
                .iter()
                .map(|v| AsRef::<str>::as_ref(name).len() + v.as_str().len() + 4)
                .sum::<usize>()
        })
        .sum();
    "NATS/1.0\r\n\r\n".len() + headers + message.payload.len()
}

/// The `Nats-Msg-Id` of `message`, if it has one.
pub fn msg_id(message: &Message) -> Option<String> {
    message
        .headers
        .get(MSG_ID_HEADER)
        .map(|value| value.as_str().to_string())
}

/// A record's headers and payload as they are published.
#[derive(Clone, Debug)]
pub struct Message {
    pub headers: HeaderMap,
    pub payload: Bytes,
}

/// Builds the message for `record`. Header names were checked by the config (route.headers) or
/// are outboxd's own; an invalid one is skipped rather than panicking the client.
pub fn message(record: &Record) -> Message {
    let mut headers = HeaderMap::new();
    let mut encoded: Vec<String> = Vec::new();
    let mut put = |headers: &mut HeaderMap, name: &str, value: &[u8]| {
        let Ok(header) = name.parse::<HeaderName>() else {
            return;
        };
        let value = match std::str::from_utf8(value)
            .ok()
            .and_then(|text| text.parse::<HeaderValue>().ok())
        {
            Some(value) => value,
            None => {
                encoded.push(name.to_string());
                base64::engine::general_purpose::STANDARD
                    .encode(value)
                    .parse()
                    .expect("base64 is one line")
            }
        };
        headers.insert(header, value);
    };
    for (name, value) in &record.headers {
        let Some(value) = value else { continue };
        put(&mut headers, name, value);
    }
    // The row id names the message for de-duplication; a dead letter the router made has none
    // (and a row's id may be empty), and its row identity (`outboxd.row`) stands in: the
    // position alone is one per transaction, and the stream would keep only its first dead letter.
    let msg_id = [ID_HEADER, ROW_HEADER].iter().find_map(|wanted| {
        record
            .headers
            .iter()
            .find(|(name, _)| name == wanted)
            .and_then(|(_, value)| value.as_deref())
            .filter(|value| !value.is_empty())
    });
    if let Some(value) = msg_id {
        put(&mut headers, MSG_ID_HEADER, value);
    }
    if let Some(key) = &record.key {
        put(&mut headers, KEY_HEADER, key);
    }
    if let Some(ms) = record.timestamp {
        headers.insert(TIMESTAMP_HEADER, ms.to_string());
    }
    if !encoded.is_empty() {
        headers.insert(BASE64_HEADER, encoded.join(","));
    }
    Message {
        headers,
        payload: Bytes::copy_from_slice(record.value.as_deref().unwrap_or_default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(headers: Vec<(&str, Option<&[u8]>)>, key: Option<&[u8]>) -> Record {
        Record {
            topic: "outbox.order".into(),
            key: key.map(<[u8]>::to_vec),
            value: Some(b"{\"a\":1}".to_vec()),
            headers: headers
                .into_iter()
                .map(|(n, v)| (n.to_string(), v.map(<[u8]>::to_vec)))
                .collect(),
            timestamp: Some(1_700_000_000_123),
            partition: None,
        }
    }

    fn get<'m>(m: &'m Message, name: &str) -> Option<&'m str> {
        m.headers.get(name).map(HeaderValue::as_str)
    }

    #[test]
    fn the_row_id_names_the_message_for_de_duplication() {
        let m = message(&record(vec![("id", Some(b"e-1"))], Some(b"order-7")));
        assert_eq!(get(&m, MSG_ID_HEADER), Some("e-1"));
        assert_eq!(get(&m, "id"), Some("e-1"));
        assert_eq!(get(&m, KEY_HEADER), Some("order-7"));
        assert_eq!(get(&m, TIMESTAMP_HEADER), Some("1700000000123"));
        assert_eq!(get(&m, BASE64_HEADER), None);
        assert_eq!(&m.payload[..], b"{\"a\":1}");
    }

    #[test]
    fn a_line_break_in_a_column_cannot_forge_a_header() {
        let hostile: &[u8] = b"x\r\nNats-Msg-Id: forged";
        let m = message(&record(
            vec![("id", Some(b"e-2")), ("traceparent", Some(hostile))],
            Some(&[0xff, 0x00, 0x10]),
        ));
        assert_eq!(get(&m, MSG_ID_HEADER), Some("e-2"));
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(get(&m, "traceparent").unwrap())
            .unwrap();
        assert_eq!(decoded, hostile);
        assert_eq!(get(&m, KEY_HEADER), Some("/wAQ"));
        assert_eq!(get(&m, BASE64_HEADER), Some("traceparent,outboxd.key"));
    }

    #[test]
    fn a_dead_letter_copy_says_why_and_fits_the_servers_limit() {
        let mut r = record(vec![("id", Some(b"e-4"))], Some(b"k"));
        r.value = Some(vec![b'x'; 5000]);
        let m = message(&r);
        let copy = dead_letter(
            &m,
            "a.b",
            "unroutable: no stream\r\nNats-Rollup: all",
            true,
            1 << 20,
        );
        assert_eq!(copy.payload.len(), 5000);
        assert_eq!(
            get(&copy, ERROR_HEADER),
            Some("unroutable: no stream  Nats-Rollup: all")
        );
        assert_eq!(get(&copy, SUBJECT_HEADER), Some("a.b"));
        assert!(copy.headers.get("Nats-Rollup").is_none());
        let small = dead_letter(&m, "a.b", "too_large", true, 1000);
        assert!(small.payload.is_empty() && wire_size(&small) <= 1000);
        assert_eq!(get(&small, MSG_ID_HEADER), Some("e-4"));
    }

    #[test]
    fn a_router_dead_letter_is_named_by_its_row_not_its_transactions_position() {
        let r = record(
            vec![
                ("outboxd.position", Some(b"gtid:0-1-5")),
                ("outboxd.row", Some(b"orders/gtid:0-1-5#2")),
            ],
            None,
        );
        assert_eq!(
            get(&message(&r), MSG_ID_HEADER),
            Some("orders/gtid:0-1-5#2")
        );
        // An empty row id names nothing: the row identity stands in for it too.
        let r = record(
            vec![
                ("id", Some(b"")),
                ("outboxd.row", Some(b"orders/gtid:0-1-5#3")),
            ],
            None,
        );
        assert_eq!(
            get(&message(&r), MSG_ID_HEADER),
            Some("orders/gtid:0-1-5#3")
        );
    }

    #[test]
    fn null_columns_are_left_out_and_a_null_payload_is_empty() {
        let mut r = record(vec![("id", Some(b"e-3")), ("tenant", None)], None);
        r.value = None;
        let m = message(&r);
        assert!(m.headers.get("tenant").is_none());
        assert!(m.headers.get(KEY_HEADER).is_none());
        assert!(m.payload.is_empty());
    }
}
