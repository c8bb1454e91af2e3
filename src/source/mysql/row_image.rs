//! The after-images of a WRITE_ROWS event, read with the column layout of its table map.
//!
//! mysql_common's row iterator describes every column of every row anew (name, schema, table and
//! charset copied into a fresh `Column`, the table map's optional metadata parsed again), which was
//! the largest single cost of a profiled backlog drain. The framing of an image is simple and stable
//! (a null bitmap over the columns present, then the non-null values in column order), so it is read
//! here; each value is still decoded by mysql_common's `BinlogValue`, so the type rules stay theirs.

use std::io;

use mysql_common::binlog::value::BinlogValue;
use mysql_common::io::ParseBuf;

use super::columns::{self, TableColumns};
use crate::source::Value;

/// Reads every row image in `data` (the rows part of a WRITE_ROWS event) and hands each row's values,
/// in table order, to `row`. `present[i]` says whether column `i` is in the images at all; a column
/// that is not is reported as NULL.
pub fn read_after_images(
    columns: &TableColumns,
    present: &[bool],
    data: &[u8],
    mut row: impl FnMut(Vec<Value>),
) -> io::Result<()> {
    let count = columns.layout.len();
    if present.len() != count {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the rows event has {} columns, its table map {count}",
                present.len()
            ),
        ));
    }
    let in_image = present.iter().filter(|p| **p).count();
    let bitmap_len = in_image.div_ceil(8);
    let mut buf = ParseBuf(data);
    while !buf.is_empty() {
        let nulls: &[u8] = buf
            .checked_eat(bitmap_len)
            .ok_or_else(|| short("null bitmap"))?;
        let mut values = Vec::with_capacity(count);
        let mut image_idx = 0;
        for (i, layout) in columns.layout.iter().enumerate() {
            if !present[i] {
                values.push(Value::Null);
                continue;
            }
            let is_null = nulls[image_idx / 8] & (1 << (image_idx % 8)) != 0;
            image_idx += 1;
            if is_null {
                values.push(Value::Null);
                continue;
            }
            let ctx = (layout.ty, &*layout.meta, columns.kinds[i].unsigned, false);
            let value: BinlogValue<'_> = buf.parse(ctx)?;
            values.push(columns::convert(columns, i, value));
        }
        row(values);
    }
    Ok(())
}

fn short(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("the row image ends inside its {what}"),
    )
}
