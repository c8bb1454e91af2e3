//! pgoutput sends column values in Postgres's text output format (the replication connection's
//! `client_encoding` is UTF8). This turns them into [`Value`]s by type OID, so the router renders them
//! the way the design contract says: JSON stays JSON text, `bytea` becomes bytes, timestamps become
//! RFC 3339 in UTC with microseconds.

use crate::source::Value;

const BOOL: u32 = 16;
const BYTEA: u32 = 17;
const INT8: u32 = 20;
const INT2: u32 = 21;
const INT4: u32 = 23;
const OID: u32 = 26;
const JSON: u32 = 114;
const FLOAT4: u32 = 700;
const FLOAT8: u32 = 701;
const TIMESTAMP: u32 = 1114;
const TIMESTAMPTZ: u32 = 1184;
const NUMERIC: u32 = 1700;
const JSONB: u32 = 3802;

/// [`from_text`] for a value the caller owns: text, JSON and numbers keep its buffer.
pub fn from_text_owned(type_oid: u32, bytes: Vec<u8>) -> Value {
    match type_oid {
        BOOL | INT2 | INT4 | INT8 | OID | BYTEA | TIMESTAMP | TIMESTAMPTZ => {
            from_text(type_oid, &bytes)
        }
        _ => match String::from_utf8(bytes) {
            Ok(text) => match type_oid {
                FLOAT4 | FLOAT8 | NUMERIC => Value::Decimal(text),
                JSON | JSONB => Value::Json(text),
                _ => Value::Text(text),
            },
            Err(e) => from_text(type_oid, e.as_bytes()),
        },
    }
}

/// Converts one text-format value of a column of type `type_oid`.
pub fn from_text(type_oid: u32, bytes: &[u8]) -> Value {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return Value::BadText {
            bytes: bytes.to_vec(),
            charset: "UTF8".into(),
        };
    };
    match type_oid {
        BOOL => Value::Text(if text == "t" { "true" } else { "false" }.into()),
        INT2 | INT4 | INT8 => text
            .parse()
            .map(Value::Int)
            .unwrap_or_else(|_| Value::Text(text.into())),
        OID => text
            .parse()
            .map(Value::UInt)
            .unwrap_or_else(|_| Value::Text(text.into())),
        FLOAT4 | FLOAT8 | NUMERIC => Value::Decimal(text.into()),
        JSON | JSONB => Value::Json(text.into()),
        BYTEA => decode_bytea(text)
            .map(Value::Binary)
            .unwrap_or(Value::BadText {
                bytes: bytes.to_vec(),
                charset: "bytea hex".into(),
            }),
        TIMESTAMP => timestamp(text, false).unwrap_or_else(|| Value::Text(text.into())),
        TIMESTAMPTZ => timestamp(text, true).unwrap_or_else(|| Value::Text(text.into())),
        _ => Value::Text(text.into()),
    }
}

/// `\x0a0b…` (the default `bytea_output = hex`).
fn decode_bytea(text: &str) -> Option<Vec<u8>> {
    let hex = text.strip_prefix("\\x")?;
    if hex.len() % 2 != 0 {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

/// `2024-01-02 03:04:05.123456+00` (or without zone) -> RFC 3339 UTC with microseconds.
fn timestamp(text: &str, with_zone: bool) -> Option<Value> {
    let utc = if with_zone {
        // Offsets come as +HH, +HH:MM or +HH:MM:SS depending on the zone.
        let parsed = chrono::DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z").ok()?;
        parsed.with_timezone(&chrono::Utc)
    } else {
        chrono::NaiveDateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f")
            .ok()?
            .and_utc()
    };
    Some(Value::Temporal(
        utc.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_by_type() {
        assert_eq!(from_text(INT8, b"-42"), Value::Int(-42));
        assert_eq!(from_text(BOOL, b"t"), Value::Text("true".into()));
        assert_eq!(
            from_text(JSONB, br#"{"a": 1}"#),
            Value::Json(r#"{"a": 1}"#.into())
        );
        assert_eq!(from_text(NUMERIC, b"12.50"), Value::Decimal("12.50".into()));
        assert_eq!(from_text(BYTEA, b"\\x00ff"), Value::Binary(vec![0, 0xff]));
        assert_eq!(from_text(25, "café".as_bytes()), Value::Text("café".into()));
        assert!(matches!(from_text(25, &[0xff]), Value::BadText { .. }));
        assert_eq!(
            from_text(TIMESTAMPTZ, b"2024-01-02 03:04:05.5+02"),
            Value::Temporal("2024-01-02T01:04:05.500000Z".into())
        );
        assert_eq!(
            from_text(TIMESTAMPTZ, b"2024-01-02 03:04:05+05:30"),
            Value::Temporal("2024-01-01T21:34:05.000000Z".into())
        );
        assert_eq!(
            from_text(TIMESTAMP, b"2024-01-02 03:04:05.000001"),
            Value::Temporal("2024-01-02T03:04:05.000001Z".into())
        );
    }

    #[test]
    fn owned_values_convert_exactly_like_borrowed_ones() {
        let cases: [(u32, &[u8]); 12] = [
            (INT8, b"-42"),
            (INT8, b"x"),
            (BOOL, b"f"),
            (OID, b"7"),
            (JSONB, br#"{"a": 1}"#),
            (JSON, b"[]"),
            (NUMERIC, b"12.50"),
            (FLOAT8, b"1e3"),
            (BYTEA, b"\\x00ff"),
            (25, "café".as_bytes()),
            (25, &[0xff, 0x41]),
            (TIMESTAMPTZ, b"2024-01-02 03:04:05.5+02"),
        ];
        for (oid, bytes) in cases {
            assert_eq!(
                from_text_owned(oid, bytes.to_vec()),
                from_text(oid, bytes),
                "{oid}"
            );
        }
    }
}
