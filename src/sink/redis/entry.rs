//! A record as a stream entry's fields (pure; no I/O). Redis fields are binary-safe, so every
//! value goes as it is: no encoding, nothing a row could forge.

use crate::route::Record;

/// An entry's fields: name and value, in order.
pub type Fields = Vec<(String, Vec<u8>)>;

/// The fields of one `XADD`, in order: the headers (the row id is header `id`), then `key`,
/// `payload` and `timestamp` when the record has them. A NULL header column is left out; a NULL
/// payload (a tombstone) leaves `payload` out.
pub fn fields(record: &Record) -> Fields {
    let mut fields: Fields = record
        .headers
        .iter()
        .filter_map(|(name, value)| Some((name.clone(), value.clone()?)))
        .collect();
    if let Some(key) = &record.key {
        fields.push(("key".into(), key.clone()));
    }
    if let Some(value) = &record.value {
        fields.push(("payload".into(), value.clone()));
    }
    if let Some(ms) = record.timestamp {
        fields.push(("timestamp".into(), ms.to_string().into_bytes()));
    }
    fields
}

/// Bytes an entry's fields take.
pub fn size(fields: &[(String, Vec<u8>)]) -> usize {
    fields.iter().map(|(n, v)| n.len() + v.len()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_key_payload_and_time_become_fields_and_nulls_are_left_out() {
        let record = Record {
            topic: "outbox.event.order".into(),
            key: Some(vec![0xff, b'\r', b'\n']),
            value: None,
            headers: vec![
                ("id".into(), Some(b"e-1".to_vec())),
                ("tenant".into(), None),
            ],
            timestamp: Some(1_700_000_000_123),
            partition: None,
        };
        let f = fields(&record);
        assert_eq!(
            f,
            vec![
                ("id".to_string(), b"e-1".to_vec()),
                ("key".to_string(), vec![0xff, b'\r', b'\n']),
                ("timestamp".to_string(), b"1700000000123".to_vec()),
            ]
        );
    }
}
