//! Column values as the router sees them: already decoded from the wire format, charset-converted,
//! and typed just enough to render them the way the design contract says (§4).

use base64::Engine;

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Int(i64),
    UInt(u64),
    Float(f64),
    /// Exact decimal, already in its text form.
    Decimal(String),
    /// A character column, converted to UTF-8.
    Text(String),
    /// A character column whose bytes are not valid in its declared character set (or whose character
    /// set outboxd cannot convert). Kept raw so nothing is lost; the router refuses it.
    BadText {
        bytes: Vec<u8>,
        charset: String,
    },
    /// A binary column (BINARY, VARBINARY, BLOB, BIT).
    Binary(Vec<u8>),
    /// A JSON column, as JSON text.
    Json(String),
    /// Date/time, already rendered (RFC 3339 with microseconds for date-times).
    Temporal(String),
}

impl Value {
    /// The value as text, the way headers, keys and topic names carry it.
    /// `None` for NULL and for text that is not valid in its character set.
    pub fn render(&self) -> Option<String> {
        self.render_as(true)
    }

    /// [`Value::render`], with 16-byte binaries as base64 rather than UUID text when `uuid16` is
    /// false (as Debezium's default `binary.handling.mode=bytes` writes them).
    pub fn render_as(&self, uuid16: bool) -> Option<String> {
        Some(match self {
            Value::Null | Value::BadText { .. } => return None,
            Value::Int(v) => v.to_string(),
            Value::UInt(v) => v.to_string(),
            Value::Float(v) => v.to_string(),
            Value::Decimal(s) | Value::Text(s) | Value::Json(s) | Value::Temporal(s) => s.clone(),
            Value::Binary(b) if uuid16 => render_binary(b),
            Value::Binary(b) => base64::engine::general_purpose::STANDARD.encode(b),
        })
    }

    /// The value's bytes as stored (record values: JSON stays JSON text, binary stays binary).
    pub fn to_bytes(&self) -> Option<Vec<u8>> {
        match self {
            Value::Null | Value::BadText { .. } => None,
            Value::Binary(b) => Some(b.clone()),
            other => other.render().map(String::into_bytes),
        }
    }

    /// Bytes of the value's own data (0 for numbers and NULL).
    pub fn size(&self) -> usize {
        match self {
            Value::Null | Value::Int(_) | Value::UInt(_) | Value::Float(_) => 0,
            Value::Decimal(s) | Value::Text(s) | Value::Json(s) | Value::Temporal(s) => s.len(),
            Value::BadText { bytes, .. } | Value::Binary(bytes) => bytes.len(),
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }

    /// The value as JSON, for the dead-letter record's raw-row body.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Value::Null => serde_json::Value::Null,
            Value::Int(v) => (*v).into(),
            Value::UInt(v) => (*v).into(),
            Value::Float(v) => serde_json::Number::from_f64(*v)
                .map(serde_json::Value::Number)
                .unwrap_or(serde_json::Value::Null),
            Value::BadText { bytes, .. } => base64::engine::general_purpose::STANDARD
                .encode(bytes)
                .into(),
            other => other.render().unwrap_or_default().into(),
        }
    }
}

/// 16 bytes are a UUID (canonical text); anything else binary is base64.
pub fn render_binary(b: &[u8]) -> String {
    match <[u8; 16]>::try_from(b) {
        Ok(raw) => uuid::Uuid::from_bytes(raw).hyphenated().to_string(),
        Err(_) => base64::engine::general_purpose::STANDARD.encode(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_per_contract() {
        let id: Vec<u8> = (0u8..16).collect();
        assert_eq!(
            Value::Binary(id).render().unwrap(),
            "00010203-0405-0607-0809-0a0b0c0d0e0f"
        );
        assert_eq!(Value::Binary(vec![0xff, 0]).render().unwrap(), "/wA=");
        assert_eq!(
            Value::Binary((0u8..16).collect()).render_as(false).unwrap(),
            "AAECAwQFBgcICQoLDA0ODw=="
        );
        assert_eq!(Value::Int(-5).render().unwrap(), "-5");
        assert_eq!(
            Value::UInt(u64::MAX).render().unwrap(),
            "18446744073709551615"
        );
        assert_eq!(Value::Null.render(), None);
        assert_eq!(
            Value::BadText {
                bytes: vec![0xe9],
                charset: "utf8mb4".into()
            }
            .render(),
            None
        );
        assert_eq!(Value::Binary(vec![1, 2]).to_bytes().unwrap(), vec![1, 2]);
    }
}
