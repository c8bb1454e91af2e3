//! What each column of an outbox table is called and how its bytes are to be read.
//!
//! Row events carry values by position only. Names (and character sets, and signedness) come from the
//! table map's optional metadata when the server writes it (`binlog_row_metadata=FULL`); otherwise we
//! ask `information_schema` once per table map and check that the column count still matches. The
//! metadata path is exact even across `ALTER TABLE`; the lookup path is only as good as the table's
//! current shape, which is why `FULL` is recommended.

use std::io;
use std::sync::Arc;

use mysql_common::binlog::events::{OptionalMetaExtractor, TableMapEvent};
use mysql_common::binlog::value::BinlogValue;
use mysql_common::constants::ColumnType;
#[allow(unused_imports)]
use mysql_common::constants::ColumnType::*;
use mysql_common::value::Value as MyValue;

use crate::source::Value;

/// How a character column's bytes are to be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Charset {
    /// `binary` (BINARY, VARBINARY, BLOB): bytes, not text.
    Binary,
    /// `latin1`: one byte, one character. MySQL's latin1 is Windows-1252 (see [`latin1_char`]).
    Latin1,
    /// Anything else is expected to be UTF-8 (utf8mb4, utf8mb3, ascii); named for error messages.
    Utf8(String),
}

const BINARY_COLLATION: u16 = 63;

/// MySQL's `latin1` is Windows-1252, not ISO-8859-1: bytes 0x80..=0x9F are `€`, `‚`, `ƒ`, … (the
/// five bytes cp1252 leaves undefined map to the C1 controls of the same number, as MySQL's own
/// `latin1` to Unicode table does). Everything else is the byte's own code point. A 32-entry table
/// written here rather than a general encoding crate for this one mapping.
const CP1252_80_9F: [char; 32] = [
    '\u{20AC}', '\u{0081}', '\u{201A}', '\u{0192}', '\u{201E}', '\u{2026}', '\u{2020}', '\u{2021}',
    '\u{02C6}', '\u{2030}', '\u{0160}', '\u{2039}', '\u{0152}', '\u{008D}', '\u{017D}', '\u{008F}',
    '\u{0090}', '\u{2018}', '\u{2019}', '\u{201C}', '\u{201D}', '\u{2022}', '\u{2013}', '\u{2014}',
    '\u{02DC}', '\u{2122}', '\u{0161}', '\u{203A}', '\u{0153}', '\u{009D}', '\u{017E}', '\u{0178}',
];

/// One MySQL `latin1` byte as a character.
fn latin1_char(byte: u8) -> char {
    match byte {
        0x80..=0x9F => CP1252_80_9F[(byte - 0x80) as usize],
        _ => byte as char,
    }
}
const LATIN1_COLLATIONS: [u16; 8] = [5, 8, 15, 31, 47, 48, 49, 94];

impl Charset {
    fn from_collation(id: u16) -> Charset {
        if id == BINARY_COLLATION {
            Charset::Binary
        } else if LATIN1_COLLATIONS.contains(&id) {
            Charset::Latin1
        } else {
            Charset::Utf8(format!("collation id {id}"))
        }
    }
}

#[derive(Debug, Clone)]
pub struct ColumnKind {
    pub charset: Charset,
    pub unsigned: bool,
}

/// One column as `information_schema.COLUMNS` describes it.
#[derive(Debug, Clone)]
pub struct SchemaColumn {
    pub name: String,
    pub data_type: String,
    pub charset: Option<String>,
    pub column_type: String,
}

/// How column `i`'s value is laid out in a row image: its binlog type and table-map metadata.
#[derive(Debug, Clone)]
pub struct ColumnLayout {
    pub ty: ColumnType,
    pub meta: Box<[u8]>,
}

/// A table map of an outbox table, with names and kinds for each of its columns.
#[derive(Debug)]
pub struct TableColumns {
    pub table: Arc<str>,
    pub names: Arc<[Arc<str>]>,
    pub kinds: Vec<ColumnKind>,
    /// Read once from the table map: looking a column's metadata up walks all columns before it.
    pub layout: Vec<ColumnLayout>,
    pub tme: TableMapEvent<'static>,
}

fn layout_of(tme: &TableMapEvent<'_>) -> io::Result<Vec<ColumnLayout>> {
    (0..tme.columns_count() as usize)
        .map(|i| {
            Ok(ColumnLayout {
                ty: column_type(tme, i)?,
                meta: tme.get_column_metadata(i).unwrap_or(&[]).into(),
            })
        })
        .collect()
}

impl TableColumns {
    /// Uses the table map's own metadata; `None` if the server did not write column names.
    pub fn from_metadata(table: Arc<str>, tme: TableMapEvent<'static>) -> io::Result<Option<Self>> {
        let (columns, named) = Self::from_metadata_or_positions(table, tme)?;
        Ok(named.then_some(columns))
    }

    /// Uses the table map's own metadata; columns without a logged name are called `@0`, `@1`, …
    /// (their position). The flag says whether the names were logged.
    pub fn from_metadata_or_positions(
        table: Arc<str>,
        tme: TableMapEvent<'static>,
    ) -> io::Result<(Self, bool)> {
        let count = tme.columns_count() as usize;
        let extractor = OptionalMetaExtractor::new(tme.iter_optional_meta())?;
        let logged: Vec<Arc<str>> = extractor
            .iter_column_name()
            .map(|n| n.map(|n| Arc::from(n.name().as_ref())))
            .collect::<io::Result<_>>()?;
        let named = logged.len() == count;
        let names: Vec<Arc<str>> = if named {
            logged
        } else {
            (0..count)
                .map(|i| Arc::from(format!("@{i}").as_str()))
                .collect()
        };
        let mut charsets = extractor.iter_charset();
        let mut signedness = extractor.iter_signedness();
        let mut kinds = Vec::with_capacity(count);
        for i in 0..count {
            let ty = column_type(&tme, i)?;
            let mut kind = ColumnKind {
                charset: Charset::Utf8("unknown".into()),
                unsigned: false,
            };
            if ty.is_character_type() {
                if let Some(id) = charsets.next().transpose()? {
                    kind.charset = Charset::from_collation(id);
                }
            } else if ty.is_numeric_type() {
                kind.unsigned = signedness.next().unwrap_or(false);
            }
            kinds.push(kind);
        }
        drop(charsets);
        drop(signedness);
        drop(extractor);
        Ok((
            TableColumns {
                table,
                names: names.into(),
                kinds,
                layout: layout_of(&tme)?,
                tme,
            },
            named,
        ))
    }

    /// Uses the table's current definition; `Err` names the mismatch when it no longer fits the map.
    pub fn from_schema(
        table: Arc<str>,
        tme: TableMapEvent<'static>,
        columns: &[SchemaColumn],
    ) -> Result<Self, String> {
        let count = tme.columns_count() as usize;
        if columns.len() != count {
            return Err(format!(
                "the binlog has {count} columns for {table} but information_schema lists {} (the table was altered since)",
                columns.len()
            ));
        }
        let names: Vec<Arc<str>> = columns.iter().map(|c| Arc::from(c.name.as_str())).collect();
        let kinds = columns
            .iter()
            .map(|c| {
                let charset = match c.charset.as_deref() {
                    None => Charset::Binary,
                    Some("latin1") => Charset::Latin1,
                    Some("binary") => Charset::Binary,
                    Some(other) => Charset::Utf8(other.to_string()),
                };
                ColumnKind {
                    charset,
                    unsigned: c.column_type.contains("unsigned"),
                }
            })
            .collect();
        let layout = layout_of(&tme).map_err(|e| format!("the table map of {table}: {e}"))?;
        Ok(TableColumns {
            table,
            names: names.into(),
            kinds,
            layout,
            tme,
        })
    }
}

fn column_type(tme: &TableMapEvent<'_>, i: usize) -> io::Result<ColumnType> {
    match tme.get_column_type(i) {
        Ok(Some(t)) => Ok(t),
        Ok(None) => Err(io::Error::new(io::ErrorKind::InvalidData, "no column type")),
        Err(e) => Err(io::Error::new(io::ErrorKind::InvalidData, e)),
    }
}

/// Converts one decoded binlog value of column `i` into our [`Value`].
pub fn convert(columns: &TableColumns, i: usize, value: BinlogValue<'_>) -> Value {
    let kind = &columns.kinds[i];
    let layout = &columns.layout[i];
    let ty = layout.ty;
    match value {
        BinlogValue::Value(MyValue::Bytes(mut b))
            if ty == ColumnType::MYSQL_TYPE_STRING && kind.charset == Charset::Binary =>
        {
            // BINARY(N) values are logged without their trailing zero padding; put it back so a
            // BINARY(16) id stays 16 bytes (and renders as a UUID).
            if let Some(len) = fixed_string_len(Some(&layout.meta)) {
                if b.len() < len {
                    b.resize(len, 0);
                }
            }
            Value::Binary(b)
        }
        BinlogValue::Value(v) => convert_plain(ty, kind, v),
        BinlogValue::Jsonb(j) => match super::json_text::to_text(j) {
            Ok(text) => Value::Json(text),
            Err(e) => Value::BadText {
                bytes: e.to_string().into_bytes(),
                charset: "binary JSON".into(),
            },
        },
        // Partial JSON updates only occur in UPDATE events, which are never converted.
        BinlogValue::JsonDiff(_) => Value::Null,
    }
}

/// Converts a value of a query result (binary protocol, session `time_zone = '+00:00'`) the way
/// [`convert`] converts the same column's binlog value, so a snapshot row and a logged row of the
/// same data become the same record.
pub fn convert_selected(column: &mysql_async::Column, value: MyValue) -> Value {
    let ty = column.column_type();
    let kind = ColumnKind {
        charset: Charset::from_collation(column.character_set()),
        unsigned: column
            .flags()
            .contains(mysql_async::consts::ColumnFlags::UNSIGNED_FLAG),
    };
    match value {
        // MySQL's JSON type is reported with the binary character set; its text is UTF-8.
        MyValue::Bytes(b) if ty == ColumnType::MYSQL_TYPE_JSON => match String::from_utf8(b) {
            Ok(text) => Value::Json(text),
            Err(e) => Value::BadText {
                bytes: e.into_bytes(),
                charset: "JSON".into(),
            },
        },
        // A TIMESTAMP arrives as a date-time in the session's UTC and renders like the log's epoch.
        v => convert_plain(ty, &kind, v),
    }
}

/// Declared byte length of a CHAR/BINARY column from its table-map metadata (two bytes that pack the
/// real type and a 10-bit length).
fn fixed_string_len(meta: Option<&[u8]>) -> Option<usize> {
    let meta = meta?;
    let (b0, b1) = (*meta.first()? as usize, *meta.get(1)? as usize);
    if b0 & 0x30 != 0x30 {
        Some((((b0 & 0x30) ^ 0x30) << 4) | b1)
    } else {
        Some(b1)
    }
}

fn convert_plain(ty: ColumnType, kind: &ColumnKind, v: MyValue) -> Value {
    use ColumnType::*;
    match v {
        MyValue::NULL => Value::Null,
        MyValue::Int(i) if kind.unsigned && i < 0 => Value::UInt(match ty {
            MYSQL_TYPE_TINY => i as i8 as u8 as u64,
            MYSQL_TYPE_SHORT => i as i16 as u16 as u64,
            MYSQL_TYPE_INT24 => (i as u64) & 0xff_ffff,
            MYSQL_TYPE_LONG => i as i32 as u32 as u64,
            _ => i as u64,
        }),
        MyValue::Int(i) if ty == MYSQL_TYPE_TIMESTAMP => rfc3339_from_epoch(i, 0),
        MyValue::Int(i) => Value::Int(i),
        MyValue::UInt(u) => Value::UInt(u),
        MyValue::Float(f) => Value::Float(f as f64),
        MyValue::Double(f) => Value::Float(f),
        MyValue::Date(y, mo, d, h, mi, s, us) => {
            if ty == MYSQL_TYPE_DATE || ty == MYSQL_TYPE_NEWDATE {
                Value::Temporal(format!("{y:04}-{mo:02}-{d:02}"))
            } else {
                Value::Temporal(format!(
                    "{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}.{us:06}Z"
                ))
            }
        }
        MyValue::Time(neg, days, h, mi, s, us) => {
            let hours = days as u64 * 24 + h as u64;
            let sign = if neg { "-" } else { "" };
            Value::Temporal(format!("{sign}{hours:02}:{mi:02}:{s:02}.{us:06}"))
        }
        MyValue::Bytes(b) => convert_bytes(ty, kind, b),
    }
}

fn convert_bytes(ty: ColumnType, kind: &ColumnKind, b: Vec<u8>) -> Value {
    use ColumnType::*;
    match ty {
        MYSQL_TYPE_NEWDECIMAL | MYSQL_TYPE_DECIMAL => {
            Value::Decimal(String::from_utf8_lossy(&b).into_owned())
        }
        MYSQL_TYPE_YEAR => Value::Int(String::from_utf8_lossy(&b).parse().unwrap_or(0)),
        MYSQL_TYPE_TIMESTAMP2 => {
            let text = String::from_utf8_lossy(&b);
            let (secs, micros) = text.split_once('.').unwrap_or((&text, "0"));
            rfc3339_from_epoch(secs.parse().unwrap_or(0), micros.parse().unwrap_or(0))
        }
        MYSQL_TYPE_BIT | MYSQL_TYPE_SET => {
            Value::UInt(b.iter().fold(0u64, |acc, byte| (acc << 8) | *byte as u64))
        }
        MYSQL_TYPE_GEOMETRY => Value::Binary(b),
        _ => match &kind.charset {
            Charset::Binary => Value::Binary(b),
            Charset::Latin1 => Value::Text(b.iter().map(|&c| latin1_char(c)).collect()),
            Charset::Utf8(name) => match String::from_utf8(b) {
                Ok(s) => Value::Text(s),
                Err(e) => Value::BadText {
                    bytes: e.into_bytes(),
                    charset: name.clone(),
                },
            },
        },
    }
}

fn rfc3339_from_epoch(secs: i64, micros: u32) -> Value {
    match chrono::DateTime::from_timestamp(secs, micros * 1000) {
        Some(t) => Value::Temporal(t.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()),
        None => Value::Int(secs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(charset: Charset, unsigned: bool) -> ColumnKind {
        ColumnKind { charset, unsigned }
    }

    #[test]
    fn text_binary_and_latin1() {
        use ColumnType::*;
        let utf8 = kind(Charset::Utf8("utf8mb4".into()), false);
        assert_eq!(
            convert_plain(
                MYSQL_TYPE_VARCHAR,
                &utf8,
                MyValue::Bytes("héllo 🎉".as_bytes().to_vec())
            ),
            Value::Text("héllo 🎉".into())
        );
        assert!(matches!(
            convert_plain(MYSQL_TYPE_VARCHAR, &utf8, MyValue::Bytes(vec![0xe9])),
            Value::BadText { .. }
        ));
        let latin1 = kind(Charset::Latin1, false);
        assert_eq!(
            convert_plain(
                MYSQL_TYPE_VARCHAR,
                &latin1,
                MyValue::Bytes(vec![b'c', 0xe9])
            ),
            Value::Text("cé".into())
        );
        // MySQL's latin1 is cp1252: 0x80 is the euro sign, 0x93/0x94 curly quotes.
        assert_eq!(
            convert_plain(
                MYSQL_TYPE_VARCHAR,
                &latin1,
                MyValue::Bytes(vec![0x80, b' ', 0x93, b'q', 0x94, 0x81])
            ),
            Value::Text("€ \u{201C}q\u{201D}\u{0081}".into())
        );
        let bin = kind(Charset::Binary, false);
        assert_eq!(
            convert_plain(MYSQL_TYPE_STRING, &bin, MyValue::Bytes(vec![1; 16])),
            Value::Binary(vec![1; 16])
        );
    }

    #[test]
    fn fixed_string_length_from_metadata() {
        // BINARY(16): real type 0xfe (STRING), length 16.
        assert_eq!(fixed_string_len(Some(&[0xfe, 16])), Some(16));
        // CHAR(255) in utf8mb4 = 1020 bytes: the high length bits hide in the type byte.
        assert_eq!(fixed_string_len(Some(&[0xce, 0xfc])), Some(1020));
        assert_eq!(fixed_string_len(None), None);
    }

    #[test]
    fn numbers_and_times() {
        use ColumnType::*;
        let unsigned = kind(Charset::Binary, true);
        assert_eq!(
            convert_plain(MYSQL_TYPE_LONGLONG, &unsigned, MyValue::Int(-1)),
            Value::UInt(u64::MAX)
        );
        assert_eq!(
            convert_plain(MYSQL_TYPE_LONG, &unsigned, MyValue::Int(-1)),
            Value::UInt(u32::MAX as u64)
        );
        let plain = kind(Charset::Binary, false);
        assert_eq!(
            convert_plain(
                MYSQL_TYPE_DATETIME2,
                &plain,
                MyValue::Date(2024, 1, 2, 3, 4, 5, 6)
            ),
            Value::Temporal("2024-01-02T03:04:05.000006Z".into())
        );
        assert_eq!(
            convert_plain(
                MYSQL_TYPE_TIMESTAMP2,
                &plain,
                MyValue::Bytes(b"1700000000.000005".to_vec())
            ),
            Value::Temporal("2023-11-14T22:13:20.000005Z".into())
        );
        assert_eq!(
            convert_plain(
                MYSQL_TYPE_NEWDECIMAL,
                &plain,
                MyValue::Bytes(b"-1.50".to_vec())
            ),
            Value::Decimal("-1.50".into())
        );
    }
}
