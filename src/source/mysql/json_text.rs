//! MySQL binary JSON -> JSON text, printed the way MySQL prints it (`SELECT json_col`), so a payload
//! forwarded by outboxd is byte-identical to what the application reads back from the table.
//!
//! That means: keys in their stored order (MySQL sorts them by length, then bytes), `": "` and `", "`
//! as separators, only `"`, `\` and control characters escaped, decimals unquoted, and dates, times
//! and datetimes inside JSON quoted with microseconds.

use std::fmt::Write;
use std::io;

use mysql_common::binlog::jsonb::{JsonDom, JsonNumber, JsonScalar, Value};

/// MySQL refuses documents nested deeper than 100; deeper input is damaged, not data.
const MAX_DEPTH: usize = 100;

pub fn to_text(value: Value<'_>) -> io::Result<String> {
    let mut out = String::new();
    write_value(&mut out, value, 0)?;
    Ok(out)
}

fn write_value(out: &mut String, value: Value<'_>, depth: usize) -> io::Result<()> {
    if depth > MAX_DEPTH {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "JSON nested deeper than MySQL allows",
        ));
    }
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if b { "true" } else { "false" }),
        Value::I16(x) => write!(out, "{x}").expect("string"),
        Value::U16(x) => write!(out, "{x}").expect("string"),
        Value::I32(x) => write!(out, "{x}").expect("string"),
        Value::U32(x) => write!(out, "{x}").expect("string"),
        Value::I64(x) => write!(out, "{x}").expect("string"),
        Value::U64(x) => write!(out, "{x}").expect("string"),
        Value::F64(x) => write_double(out, x),
        Value::String(s) => {
            let raw = s.str_raw();
            let text = std::str::from_utf8(raw)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            write_string(out, text);
        }
        Value::SmallArray(a) => write_array(out, a.iter(), depth)?,
        Value::LargeArray(a) => write_array(out, a.iter(), depth)?,
        Value::SmallObject(o) => write_object(out, o.iter(), depth)?,
        Value::LargeObject(o) => write_object(out, o.iter(), depth)?,
        opaque @ Value::Opaque(_) => match opaque.parse()? {
            JsonDom::Scalar(JsonScalar::Number(JsonNumber::Decimal(d))) => {
                write!(out, "{d}").expect("string")
            }
            JsonDom::Scalar(JsonScalar::DateTime(t)) => write_string(out, &format!("{t:.6}")),
            other => {
                // Other opaque types print as MySQL does: "base64:type<N>:<data>".
                let json: serde_json::Value = other.into();
                out.push_str(&json.to_string());
            }
        },
    }
    Ok(())
}

fn write_array<'a>(
    out: &mut String,
    items: impl Iterator<Item = io::Result<Value<'a>>>,
    depth: usize,
) -> io::Result<()> {
    out.push('[');
    for (i, item) in items.enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        write_value(out, item?, depth + 1)?;
    }
    out.push(']');
    Ok(())
}

fn write_object<'a>(
    out: &mut String,
    entries: impl Iterator<Item = io::Result<(mysql_common::binlog::jsonb::ObjectKey<'a>, Value<'a>)>>,
    depth: usize,
) -> io::Result<()> {
    out.push('{');
    for (i, entry) in entries.enumerate() {
        let (key, value) = entry?;
        if i > 0 {
            out.push_str(", ");
        }
        let key = std::str::from_utf8(key.value_raw())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        write_string(out, key);
        out.push_str(": ");
        write_value(out, value, depth + 1)?;
    }
    out.push('}');
    Ok(())
}

fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => write!(out, "\\u{:04x}", c as u32).expect("string"),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Shortest round-trip digits; plain notation for moderate magnitudes, `1e20` style otherwise.
fn write_double(out: &mut String, x: f64) {
    let magnitude = x.abs();
    if x == 0.0 || (1e-5..1e15).contains(&magnitude) {
        // Integral doubles print without a fraction, as MySQL prints them.
        write!(out, "{x}").expect("string");
    } else {
        write!(out, "{x:e}").expect("string");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_and_doubles_print_like_mysql() {
        let mut s = String::new();
        write_string(&mut s, "a\"b\\c\nd\u{1}é🎉/");
        assert_eq!(s, r#""a\"b\\c\nd\u0001é🎉/""#);
        let double = |x: f64| {
            let mut s = String::new();
            write_double(&mut s, x);
            s
        };
        assert_eq!(double(2.75), "2.75");
        assert_eq!(double(1e20), "1e20");
        assert_eq!(double(-2.5e-7), "-2.5e-7");
        assert_eq!(double(0.0), "0");
    }
}
