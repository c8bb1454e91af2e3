//! Decoder for the messages of `pgoutput`, the logical replication output plugin built into Postgres.
//!
//! The bytes arrive from the network, so a malformed or truncated message has to end the session with an
//! error saying where decoding stopped; it must never panic or quietly lose its place in the stream. To
//! make that hold, every read checks the remaining length first, counts read from the input only bound
//! the loop and never an allocation, and a message has to be consumed exactly. One `XLogData` payload
//! holds one message, so leftover bytes mean we misread it.
//!
//! Scope: one message at a time, i.e. the payload of an `XLogData` ('w') copy-data message after its
//! 24-byte header, starting with the message type byte. All protocol version 1 messages are decoded,
//! including logical decoding messages (`messages 'true'`). So are version 2's streaming messages and the
//! transaction id that version 2 puts in front of data messages inside a stream (see
//! [`decode_in_stream`]). Two-phase commit (version 3) and parallel streaming (version 4) are not.
//! Timestamps stay as Postgres sends them: microseconds since 2000-01-01 00:00:00 UTC.

use std::fmt;

/// Microseconds from the Unix epoch to the Postgres epoch (2000-01-01 00:00:00 UTC).
pub const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

/// [`RelationColumn::flags`] bit: the column is part of the replica identity key.
pub const COLUMN_FLAG_KEY: u8 = 1;
/// [`Message::Truncate`] option bit: `TRUNCATE ... CASCADE`.
pub const TRUNCATE_CASCADE: u8 = 1;
/// [`Message::Truncate`] option bit: `TRUNCATE ... RESTART IDENTITY`.
pub const TRUNCATE_RESTART_IDENTITY: u8 = 2;

/// One decoded pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// 'B': a transaction starts. `final_lsn` is the LSN of its commit record.
    Begin {
        final_lsn: u64,
        commit_time_us: i64,
        xid: u32,
    },
    /// 'C': the transaction opened by the last `Begin` committed. Resuming at `end_lsn` starts after it.
    Commit {
        flags: u8,
        commit_lsn: u64,
        end_lsn: u64,
        commit_time_us: i64,
    },
    /// 'O': the transaction was replayed from another server through replication origin `name`; `lsn`
    /// is its commit LSN on that server.
    Origin { lsn: u64, name: String },
    /// 'R': the layout of a table, sent before its first change in a session and again after it changes.
    Relation(Relation),
    /// 'Y': a non-built-in data type used by a following `Relation`. `namespace` is empty for
    /// `pg_catalog`.
    Type {
        id: u32,
        namespace: String,
        name: String,
    },
    /// 'I': a row inserted into `relation_id`.
    Insert { relation_id: u32, tuple: Tuple },
    /// 'U': a row updated; `old` is present only when the key changed or the replica identity is FULL.
    Update {
        relation_id: u32,
        old: Option<OldTuple>,
        new: Tuple,
    },
    /// 'D': a row deleted; `old` holds its key or, with replica identity FULL, the whole row.
    Delete { relation_id: u32, old: OldTuple },
    /// 'T': tables truncated together. `options` holds [`TRUNCATE_CASCADE`] and
    /// [`TRUNCATE_RESTART_IDENTITY`] bits.
    Truncate { options: u8, relation_ids: Vec<u32> },
    /// 'M': a logical decoding message written by `pg_logical_emit_message`. A transactional one
    /// belongs to the surrounding transaction; a non-transactional one is sent at once, outside any
    /// Begin/Commit pair, even if its transaction later aborts.
    Logical {
        transactional: bool,
        lsn: u64,
        prefix: String,
        content: Vec<u8>,
    },
    /// 'S' (version 2): a block of a large in-progress transaction follows. Its data messages
    /// must be decoded with [`decode_in_stream`] until `StreamStop`.
    StreamStart { xid: u32, first_segment: bool },
    /// 'E' (version 2): the current stream block ends.
    StreamStop,
    /// 'c' (version 2): the streamed transaction `xid` committed.
    StreamCommit {
        xid: u32,
        flags: u8,
        commit_lsn: u64,
        end_lsn: u64,
        commit_time_us: i64,
    },
    /// 'A' (version 2): the streamed (sub)transaction `subxid` of `xid` aborted; `subxid == xid` means
    /// the whole transaction.
    StreamAbort { xid: u32, subxid: u32 },
}

/// A table's layout as announced by a 'R' message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// The table's OID, which data messages refer to.
    pub id: u32,
    /// The schema; empty for `pg_catalog`.
    pub namespace: String,
    pub name: String,
    pub replica_identity: ReplicaIdentity,
    /// The published columns, in the order tuples carry them.
    pub columns: Vec<RelationColumn>,
}

impl Relation {
    /// `schema.table`, with the empty namespace written out as `pg_catalog`.
    pub fn qualified_name(&self) -> String {
        let namespace = if self.namespace.is_empty() {
            "pg_catalog"
        } else {
            &self.namespace
        };
        format!("{namespace}.{}", self.name)
    }
}

/// One column of a [`Relation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationColumn {
    /// Bit set; see [`COLUMN_FLAG_KEY`].
    pub flags: u8,
    pub name: String,
    pub type_oid: u32,
    /// `atttypmod`, -1 when the type has none.
    pub type_modifier: i32,
}

impl RelationColumn {
    pub fn is_key(&self) -> bool {
        self.flags & COLUMN_FLAG_KEY != 0
    }
}

/// Which old values a table's updates and deletes carry (`ALTER TABLE ... REPLICA IDENTITY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaIdentity {
    /// 'd': the primary key.
    Default,
    /// 'n': nothing.
    Nothing,
    /// 'f': every column.
    Full,
    /// 'i': the columns of a chosen unique index.
    Index,
}

/// A row's values, one per column of its [`Relation`], in column order.
pub type Tuple = Vec<TupleValue>;

/// One column value of a [`Tuple`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TupleValue {
    Null,
    /// A TOASTed value the change did not touch; Postgres does not resend it.
    UnchangedToast,
    /// The value in the type's text output format.
    Text(Vec<u8>),
    /// The value in the type's binary send format (only with the `binary` option).
    Binary(Vec<u8>),
}

/// The old row carried by an update or delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OldTuple {
    /// 'K': only the replica identity columns are set; the others are `Null`.
    Key(Tuple),
    /// 'O': the whole old row (replica identity FULL).
    Full(Tuple),
}

/// A data message from inside a stream block, with the transaction it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Streamed {
    pub xid: u32,
    pub message: Message,
}

/// Why a message could not be decoded, and where in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    /// Byte offset into the message at which decoding failed.
    pub offset: usize,
    pub what: String,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "malformed pgoutput message at byte {}: {}",
            self.offset, self.what
        )
    }
}

impl std::error::Error for DecodeError {}

/// Decodes one message sent outside a stream block: every protocol version 1 message, plus the stream
/// control messages of version 2.
pub fn decode(payload: &[u8]) -> Result<Message, DecodeError> {
    let mut input = Reader::new(payload);
    let tag = input.u8("message type")?;
    let message = match tag {
        b'B' => begin(&mut input)?,
        b'C' => commit(&mut input)?,
        b'O' => origin(&mut input)?,
        b'S' => stream_start(&mut input)?,
        b'E' => Message::StreamStop,
        b'c' => stream_commit(&mut input)?,
        b'A' => stream_abort(&mut input)?,
        _ => match data_message(tag, &mut input)? {
            Some(message) => message,
            None => return Err(unknown_tag(tag)),
        },
    };
    input.finish()?;
    Ok(message)
}

/// Decodes one message sent between `StreamStart` and `StreamStop`. Only data messages ('R', 'Y',
/// 'I', 'U', 'D', 'T', 'M') appear there, each with the streamed transaction's xid after its type byte.
pub fn decode_in_stream(payload: &[u8]) -> Result<Streamed, DecodeError> {
    let mut input = Reader::new(payload);
    let tag = input.u8("message type")?;
    if !is_data_tag(tag) {
        return Err(DecodeError {
            offset: 0,
            what: if is_control_tag(tag) {
                format!(
                    "message type {} cannot appear inside a stream",
                    describe_byte(tag)
                )
            } else {
                unknown_tag(tag).what
            },
        });
    }
    let xid = input.u32("streamed transaction id")?;
    let message = data_message(tag, &mut input)?.ok_or_else(|| unknown_tag(tag))?;
    input.finish()?;
    Ok(Streamed { xid, message })
}

/// Converts a Postgres timestamp (microseconds since 2000-01-01 UTC) to microseconds since the Unix
/// epoch; `None` if that overflows, which only values near `infinity` (i64::MAX) do.
pub fn pg_time_to_unix_micros(pg_micros: i64) -> Option<i64> {
    pg_micros.checked_add(PG_EPOCH_UNIX_MICROS)
}

fn is_data_tag(tag: u8) -> bool {
    matches!(tag, b'R' | b'Y' | b'I' | b'U' | b'D' | b'T' | b'M')
}

fn is_control_tag(tag: u8) -> bool {
    matches!(tag, b'B' | b'C' | b'O' | b'S' | b'E' | b'c' | b'A')
}

fn unknown_tag(tag: u8) -> DecodeError {
    DecodeError {
        offset: 0,
        what: format!("unknown message type {}", describe_byte(tag)),
    }
}

/// Shows a byte as a character when it is one, since message types and markers are letters.
fn describe_byte(byte: u8) -> String {
    if byte.is_ascii_graphic() {
        format!("'{}' (0x{byte:02X})", char::from(byte))
    } else {
        format!("0x{byte:02X}")
    }
}

fn begin(input: &mut Reader<'_>) -> Result<Message, DecodeError> {
    let final_lsn = input.u64("final LSN")?;
    let commit_time_us = input.i64("commit timestamp")?;
    let xid = input.u32("transaction id")?;
    Ok(Message::Begin {
        final_lsn,
        commit_time_us,
        xid,
    })
}

fn commit(input: &mut Reader<'_>) -> Result<Message, DecodeError> {
    let flags = input.u8("commit flags")?;
    let commit_lsn = input.u64("commit LSN")?;
    let end_lsn = input.u64("end LSN")?;
    let commit_time_us = input.i64("commit timestamp")?;
    Ok(Message::Commit {
        flags,
        commit_lsn,
        end_lsn,
        commit_time_us,
    })
}

fn origin(input: &mut Reader<'_>) -> Result<Message, DecodeError> {
    let lsn = input.u64("origin LSN")?;
    let name = input.string("origin name")?;
    Ok(Message::Origin { lsn, name })
}

fn stream_start(input: &mut Reader<'_>) -> Result<Message, DecodeError> {
    let xid = input.u32("transaction id")?;
    let first_segment = input.flag("first-segment flag")?;
    Ok(Message::StreamStart { xid, first_segment })
}

fn stream_commit(input: &mut Reader<'_>) -> Result<Message, DecodeError> {
    let xid = input.u32("transaction id")?;
    let flags = input.u8("commit flags")?;
    let commit_lsn = input.u64("commit LSN")?;
    let end_lsn = input.u64("end LSN")?;
    let commit_time_us = input.i64("commit timestamp")?;
    Ok(Message::StreamCommit {
        xid,
        flags,
        commit_lsn,
        end_lsn,
        commit_time_us,
    })
}

fn stream_abort(input: &mut Reader<'_>) -> Result<Message, DecodeError> {
    let xid = input.u32("transaction id")?;
    let subxid = input.u32("subtransaction id")?;
    Ok(Message::StreamAbort { xid, subxid })
}

/// The body of a data message (after the xid, inside a stream); `None` if `tag` is not a data message.
fn data_message(tag: u8, input: &mut Reader<'_>) -> Result<Option<Message>, DecodeError> {
    Ok(Some(match tag {
        b'R' => Message::Relation(relation(input)?),
        b'Y' => type_message(input)?,
        b'I' => insert(input)?,
        b'U' => update(input)?,
        b'D' => delete(input)?,
        b'T' => truncate(input)?,
        b'M' => logical(input)?,
        _ => return Ok(None),
    }))
}

fn relation(input: &mut Reader<'_>) -> Result<Relation, DecodeError> {
    let id = input.u32("relation id")?;
    let namespace = input.string("relation namespace")?;
    let name = input.string("relation name")?;
    let identity_at = input.offset();
    let replica_identity = match input.u8("replica identity")? {
        b'd' => ReplicaIdentity::Default,
        b'n' => ReplicaIdentity::Nothing,
        b'f' => ReplicaIdentity::Full,
        b'i' => ReplicaIdentity::Index,
        other => {
            return Err(DecodeError {
                offset: identity_at,
                what: format!("unknown replica identity {}", describe_byte(other)),
            })
        }
    };
    let count = input.u16("relation column count")?;
    // Each column takes at least 10 bytes, so the input, not the count, bounds the allocation.
    let mut columns = Vec::with_capacity(usize::from(count).min(input.remaining() / 10));
    for _ in 0..count {
        let flags = input.u8("column flags")?;
        let name = input.string("column name")?;
        let type_oid = input.u32("column type")?;
        let type_modifier = input.i32("column type modifier")?;
        columns.push(RelationColumn {
            flags,
            name,
            type_oid,
            type_modifier,
        });
    }
    Ok(Relation {
        id,
        namespace,
        name,
        replica_identity,
        columns,
    })
}

fn type_message(input: &mut Reader<'_>) -> Result<Message, DecodeError> {
    let id = input.u32("type id")?;
    let namespace = input.string("type namespace")?;
    let name = input.string("type name")?;
    Ok(Message::Type {
        id,
        namespace,
        name,
    })
}

fn insert(input: &mut Reader<'_>) -> Result<Message, DecodeError> {
    let relation_id = input.u32("relation id")?;
    expect_new_tuple(input)?;
    let tuple = tuple(input)?;
    Ok(Message::Insert { relation_id, tuple })
}

fn update(input: &mut Reader<'_>) -> Result<Message, DecodeError> {
    let relation_id = input.u32("relation id")?;
    let marker_at = input.offset();
    let old = match input.u8("update tuple marker")? {
        b'N' => None,
        b'K' => Some(OldTuple::Key(tuple(input)?)),
        b'O' => Some(OldTuple::Full(tuple(input)?)),
        other => return Err(unexpected_marker(marker_at, other, "'K', 'O' or 'N'")),
    };
    if old.is_some() {
        expect_new_tuple(input)?;
    }
    let new = tuple(input)?;
    Ok(Message::Update {
        relation_id,
        old,
        new,
    })
}

fn delete(input: &mut Reader<'_>) -> Result<Message, DecodeError> {
    let relation_id = input.u32("relation id")?;
    let marker_at = input.offset();
    let old = match input.u8("delete tuple marker")? {
        b'K' => OldTuple::Key(tuple(input)?),
        b'O' => OldTuple::Full(tuple(input)?),
        other => return Err(unexpected_marker(marker_at, other, "'K' or 'O'")),
    };
    Ok(Message::Delete { relation_id, old })
}

fn truncate(input: &mut Reader<'_>) -> Result<Message, DecodeError> {
    let count = input.u32("count of truncated relations")?;
    let options = input.u8("truncate options")?;
    let capacity = usize::try_from(count)
        .unwrap_or(usize::MAX)
        .min(input.remaining() / 4);
    let mut relation_ids = Vec::with_capacity(capacity);
    for _ in 0..count {
        relation_ids.push(input.u32("id of a truncated relation")?);
    }
    Ok(Message::Truncate {
        options,
        relation_ids,
    })
}

fn logical(input: &mut Reader<'_>) -> Result<Message, DecodeError> {
    let transactional = input.flag("logical message flags")?;
    let lsn = input.u64("logical message LSN")?;
    let prefix = input.string("logical message prefix")?;
    let content = input.sized_bytes("logical message content")?;
    Ok(Message::Logical {
        transactional,
        lsn,
        prefix,
        content,
    })
}

fn expect_new_tuple(input: &mut Reader<'_>) -> Result<(), DecodeError> {
    let marker_at = input.offset();
    match input.u8("new tuple marker")? {
        b'N' => Ok(()),
        other => Err(unexpected_marker(marker_at, other, "'N'")),
    }
}

fn unexpected_marker(offset: usize, found: u8, expected: &str) -> DecodeError {
    DecodeError {
        offset,
        what: format!(
            "tuple marker {} where {expected} was expected",
            describe_byte(found)
        ),
    }
}

fn tuple(input: &mut Reader<'_>) -> Result<Tuple, DecodeError> {
    let count = input.u16("tuple column count")?;
    // Each value takes at least one byte.
    let mut values = Vec::with_capacity(usize::from(count).min(input.remaining()));
    for _ in 0..count {
        let kind_at = input.offset();
        let value = match input.u8("tuple value kind")? {
            b'n' => TupleValue::Null,
            b'u' => TupleValue::UnchangedToast,
            b't' => TupleValue::Text(input.sized_bytes("text value")?),
            b'b' => TupleValue::Binary(input.sized_bytes("binary value")?),
            other => {
                return Err(DecodeError {
                    offset: kind_at,
                    what: format!("unknown tuple value kind {}", describe_byte(other)),
                })
            }
        };
        values.push(value);
    }
    Ok(values)
}

/// A cursor over one message; every read is bounds-checked and reports the offset it failed at.
struct Reader<'a> {
    bytes: &'a [u8],
    position: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, position: 0 }
    }

    fn offset(&self) -> usize {
        self.position
    }

    fn rest(&self) -> &'a [u8] {
        self.bytes.get(self.position..).unwrap_or_default()
    }

    fn remaining(&self) -> usize {
        self.rest().len()
    }

    fn truncated(&self, needed: usize, what: &str) -> DecodeError {
        DecodeError {
            offset: self.position,
            what: format!(
                "truncated {what}: needs {needed} bytes, {} left",
                self.remaining()
            ),
        }
    }

    fn take(&mut self, len: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        let taken = self
            .rest()
            .get(..len)
            .ok_or_else(|| self.truncated(len, what))?;
        self.position += len;
        Ok(taken)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], DecodeError> {
        let taken = *self
            .rest()
            .first_chunk::<N>()
            .ok_or_else(|| self.truncated(N, what))?;
        self.position += N;
        Ok(taken)
    }

    fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        self.array::<1>(what).map(|[byte]| byte)
    }

    fn u16(&mut self, what: &str) -> Result<u16, DecodeError> {
        self.array(what).map(u16::from_be_bytes)
    }

    fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        self.array(what).map(u32::from_be_bytes)
    }

    fn i32(&mut self, what: &str) -> Result<i32, DecodeError> {
        self.array(what).map(i32::from_be_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, DecodeError> {
        self.array(what).map(u64::from_be_bytes)
    }

    fn i64(&mut self, what: &str) -> Result<i64, DecodeError> {
        self.array(what).map(i64::from_be_bytes)
    }

    /// A byte Postgres only ever sets to 0 or 1; anything else means we are out of step.
    fn flag(&mut self, what: &str) -> Result<bool, DecodeError> {
        let at = self.position;
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(DecodeError {
                offset: at,
                what: format!("{what} is 0x{other:02X}, expected 0 or 1"),
            }),
        }
    }

    /// A NUL-terminated UTF-8 string.
    fn string(&mut self, what: &str) -> Result<String, DecodeError> {
        let at = self.position;
        let rest = self.rest();
        let len = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| DecodeError {
                offset: at,
                what: format!("{what} is not NUL-terminated"),
            })?;
        let text = self.take(len, what)?;
        self.position += 1; // the NUL found above
        String::from_utf8(text.to_vec()).map_err(|_| DecodeError {
            offset: at,
            what: format!("{what} is not valid UTF-8"),
        })
    }

    /// An Int32 length followed by that many bytes.
    fn sized_bytes(&mut self, what: &str) -> Result<Vec<u8>, DecodeError> {
        let at = self.position;
        let len = self.i32(what)?;
        let len = usize::try_from(len).map_err(|_| DecodeError {
            offset: at,
            what: format!("{what} has negative length {len}"),
        })?;
        Ok(self.take(len, what)?.to_vec())
    }

    fn finish(&self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            left => Err(DecodeError {
                offset: self.position,
                what: format!("{left} unexpected bytes after the message"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::postgres::lsn::{lsn_to_string, parse_lsn};

    /// Builds messages byte by byte, so each test shows the wire layout it exercises.
    struct Wire(Vec<u8>);

    impl Wire {
        fn tag(tag: u8) -> Self {
            Wire(vec![tag])
        }
        fn u8(mut self, v: u8) -> Self {
            self.0.push(v);
            self
        }
        fn u16(mut self, v: u16) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        fn u32(mut self, v: u32) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        fn i32(mut self, v: i32) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        fn u64(mut self, v: u64) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        fn i64(mut self, v: i64) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        fn string(mut self, s: &str) -> Self {
            self.0.extend_from_slice(s.as_bytes());
            self.0.push(0);
            self
        }
        fn sized(self, bytes: &[u8]) -> Self {
            let len = i32::try_from(bytes.len()).unwrap();
            let mut wire = self.i32(len);
            wire.0.extend_from_slice(bytes);
            wire
        }
        fn text(self, bytes: &[u8]) -> Self {
            self.u8(b't').sized(bytes)
        }
        fn build(self) -> Vec<u8> {
            self.0
        }
    }

    fn text(s: &str) -> TupleValue {
        TupleValue::Text(s.as_bytes().to_vec())
    }

    /// A two-column tuple `(1, NULL)` on the wire, and as decoded.
    fn small_tuple(wire: Wire) -> Wire {
        wire.u16(2).text(b"1").u8(b'n')
    }
    fn small_tuple_value() -> Tuple {
        vec![text("1"), TupleValue::Null]
    }

    /// One hand-built instance of every message type, with what it decodes to.
    fn hand_built() -> Vec<(Vec<u8>, Message)> {
        vec![
            (
                Wire::tag(b'B').u64(0x1_0000_0010).i64(-5).u32(7).build(),
                Message::Begin {
                    final_lsn: 0x1_0000_0010,
                    commit_time_us: -5,
                    xid: 7,
                },
            ),
            (
                Wire::tag(b'C').u8(0).u64(10).u64(20).i64(i64::MAX).build(),
                Message::Commit {
                    flags: 0,
                    commit_lsn: 10,
                    end_lsn: 20,
                    commit_time_us: i64::MAX,
                },
            ),
            (
                Wire::tag(b'O').u64(99).string("east").build(),
                Message::Origin {
                    lsn: 99,
                    name: "east".into(),
                },
            ),
            (
                Wire::tag(b'R')
                    .u32(16384)
                    .string("")
                    .string("pg_class")
                    .u8(b'i')
                    .u16(2)
                    .u8(1)
                    .string("id")
                    .u32(20)
                    .i32(-1)
                    .u8(0)
                    .string("naïve")
                    .u32(1043)
                    .i32(36)
                    .build(),
                Message::Relation(Relation {
                    id: 16384,
                    namespace: String::new(),
                    name: "pg_class".into(),
                    replica_identity: ReplicaIdentity::Index,
                    columns: vec![
                        RelationColumn {
                            flags: 1,
                            name: "id".into(),
                            type_oid: 20,
                            type_modifier: -1,
                        },
                        RelationColumn {
                            flags: 0,
                            name: "naïve".into(),
                            type_oid: 1043,
                            type_modifier: 36,
                        },
                    ],
                }),
            ),
            (
                Wire::tag(b'R')
                    .u32(1)
                    .string("s")
                    .string("t")
                    .u8(b'n')
                    .u16(0)
                    .build(),
                Message::Relation(Relation {
                    id: 1,
                    namespace: "s".into(),
                    name: "t".into(),
                    replica_identity: ReplicaIdentity::Nothing,
                    columns: vec![],
                }),
            ),
            (
                Wire::tag(b'Y')
                    .u32(16500)
                    .string("app")
                    .string("mood")
                    .build(),
                Message::Type {
                    id: 16500,
                    namespace: "app".into(),
                    name: "mood".into(),
                },
            ),
            (
                Wire::tag(b'I')
                    .u32(5)
                    .u8(b'N')
                    .u16(5)
                    .text(b"abc")
                    .u8(b'n')
                    .u8(b'u')
                    .u8(b'b')
                    .sized(&[0, 0xFF])
                    .text(b"")
                    .build(),
                Message::Insert {
                    relation_id: 5,
                    tuple: vec![
                        text("abc"),
                        TupleValue::Null,
                        TupleValue::UnchangedToast,
                        TupleValue::Binary(vec![0, 0xFF]),
                        text(""),
                    ],
                },
            ),
            (
                Wire::tag(b'I').u32(5).u8(b'N').u16(0).build(),
                Message::Insert {
                    relation_id: 5,
                    tuple: vec![],
                },
            ),
            (
                small_tuple(Wire::tag(b'U').u32(6).u8(b'N')).build(),
                Message::Update {
                    relation_id: 6,
                    old: None,
                    new: small_tuple_value(),
                },
            ),
            (
                small_tuple(small_tuple(Wire::tag(b'U').u32(6).u8(b'K')).u8(b'N')).build(),
                Message::Update {
                    relation_id: 6,
                    old: Some(OldTuple::Key(small_tuple_value())),
                    new: small_tuple_value(),
                },
            ),
            (
                small_tuple(small_tuple(Wire::tag(b'U').u32(6).u8(b'O')).u8(b'N')).build(),
                Message::Update {
                    relation_id: 6,
                    old: Some(OldTuple::Full(small_tuple_value())),
                    new: small_tuple_value(),
                },
            ),
            (
                small_tuple(Wire::tag(b'D').u32(8).u8(b'K')).build(),
                Message::Delete {
                    relation_id: 8,
                    old: OldTuple::Key(small_tuple_value()),
                },
            ),
            (
                small_tuple(Wire::tag(b'D').u32(8).u8(b'O')).build(),
                Message::Delete {
                    relation_id: 8,
                    old: OldTuple::Full(small_tuple_value()),
                },
            ),
            (
                Wire::tag(b'T').u32(2).u8(3).u32(10).u32(11).build(),
                Message::Truncate {
                    options: TRUNCATE_CASCADE | TRUNCATE_RESTART_IDENTITY,
                    relation_ids: vec![10, 11],
                },
            ),
            (
                Wire::tag(b'M')
                    .u8(1)
                    .u64(0x16B3748)
                    .string("outbox")
                    .sized(b"{\"a\":1}")
                    .build(),
                Message::Logical {
                    transactional: true,
                    lsn: 0x16B3748,
                    prefix: "outbox".into(),
                    content: b"{\"a\":1}".to_vec(),
                },
            ),
            (
                Wire::tag(b'M')
                    .u8(0)
                    .u64(1)
                    .string("")
                    .sized(&[0, 1, 2])
                    .build(),
                Message::Logical {
                    transactional: false,
                    lsn: 1,
                    prefix: String::new(),
                    content: vec![0, 1, 2],
                },
            ),
            (
                Wire::tag(b'S').u32(900).u8(1).build(),
                Message::StreamStart {
                    xid: 900,
                    first_segment: true,
                },
            ),
            (Wire::tag(b'E').build(), Message::StreamStop),
            (
                Wire::tag(b'c')
                    .u32(900)
                    .u8(0)
                    .u64(30)
                    .u64(40)
                    .i64(50)
                    .build(),
                Message::StreamCommit {
                    xid: 900,
                    flags: 0,
                    commit_lsn: 30,
                    end_lsn: 40,
                    commit_time_us: 50,
                },
            ),
            (
                Wire::tag(b'A').u32(900).u32(901).build(),
                Message::StreamAbort {
                    xid: 900,
                    subxid: 901,
                },
            ),
        ]
    }

    /// The same bytes with the streamed xid inserted after the type byte.
    fn with_stream_xid(bytes: &[u8], xid: u32) -> Vec<u8> {
        let mut streamed = bytes[..1].to_vec();
        streamed.extend_from_slice(&xid.to_be_bytes());
        streamed.extend_from_slice(&bytes[1..]);
        streamed
    }

    #[test]
    fn hand_built_messages_decode() {
        for (bytes, expected) in hand_built() {
            assert_eq!(decode(&bytes), Ok(expected), "bytes {bytes:02X?}");
        }
    }

    #[test]
    fn every_message_type_is_covered() {
        let tags: std::collections::BTreeSet<u8> =
            hand_built().iter().map(|(bytes, _)| bytes[0]).collect();
        assert_eq!(
            tags,
            b"BCORYIUDTMSEcA".iter().copied().collect(),
            "hand_built() must hold every message type"
        );
    }

    #[test]
    fn data_messages_decode_in_stream_with_their_xid() {
        for (bytes, expected) in hand_built() {
            let streamed = with_stream_xid(&bytes, 0xDEAD_BEEF);
            if is_data_tag(bytes[0]) {
                assert_eq!(
                    decode_in_stream(&streamed),
                    Ok(Streamed {
                        xid: 0xDEAD_BEEF,
                        message: expected
                    })
                );
            } else {
                let err = decode_in_stream(&bytes).unwrap_err();
                assert!(err.what.contains("cannot appear inside a stream"), "{err}");
            }
        }
    }

    /// Every valid message we have, each with whether it was sent inside a stream block.
    fn all_valid_messages() -> Vec<(Vec<u8>, bool)> {
        let mut messages = Vec::new();
        for (bytes, _) in hand_built() {
            if is_data_tag(bytes[0]) {
                messages.push((with_stream_xid(&bytes, 1), true));
            }
            messages.push((bytes, false));
        }
        for (name, bytes) in FIXTURES {
            messages.push((bytes.to_vec(), fixture_is_in_stream(name)));
        }
        messages
    }

    fn decode_framed(bytes: &[u8], in_stream: bool) -> Result<Message, DecodeError> {
        if in_stream {
            decode_in_stream(bytes).map(|streamed| streamed.message)
        } else {
            decode(bytes)
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        for (bytes, in_stream) in all_valid_messages() {
            assert!(decode_framed(&bytes, in_stream).is_ok());
            for len in 0..bytes.len() {
                assert!(
                    decode_framed(&bytes[..len], in_stream).is_err(),
                    "prefix {len} of {bytes:02X?} decoded"
                );
            }
        }
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        for (mut bytes, _) in hand_built() {
            let len = bytes.len();
            bytes.push(0);
            let err = decode(&bytes).unwrap_err();
            assert_eq!(err.offset, len, "{err}");
            assert!(err.what.contains("1 unexpected bytes"), "{err}");
        }
    }

    #[test]
    fn unknown_message_type_names_the_byte() {
        let err = decode(b"Zabc").unwrap_err();
        assert_eq!(err.offset, 0);
        assert_eq!(
            err.to_string(),
            "malformed pgoutput message at byte 0: unknown message type 'Z' (0x5A)"
        );
        assert!(decode(&[0x07])
            .unwrap_err()
            .what
            .contains("unknown message type 0x07"));
        assert!(decode_in_stream(b"Z\0\0\0\x01")
            .unwrap_err()
            .what
            .contains("unknown message type 'Z'"));
        assert!(decode(&[])
            .unwrap_err()
            .what
            .contains("truncated message type"));
    }

    #[test]
    fn malformed_fields_are_errors_with_offsets() {
        let cases: Vec<(Vec<u8>, usize, &str)> = vec![
            (
                Wire::tag(b'I').u32(1).u8(b'N').u16(1).u8(b'x').build(),
                8,
                "unknown tuple value kind 'x'",
            ),
            (
                Wire::tag(b'I')
                    .u32(1)
                    .u8(b'N')
                    .u16(1)
                    .u8(b't')
                    .i32(-1)
                    .build(),
                9,
                "negative length -1",
            ),
            (
                Wire::tag(b'I').u32(1).u8(b'K').u16(0).build(),
                5,
                "marker 'K' (0x4B) where 'N' was expected",
            ),
            (
                Wire::tag(b'U')
                    .u32(1)
                    .u8(b'K')
                    .u16(0)
                    .u8(b'O')
                    .u16(0)
                    .build(),
                8,
                "marker 'O' (0x4F) where 'N' was expected",
            ),
            (
                Wire::tag(b'U').u32(1).u8(b'X').u16(0).build(),
                5,
                "'K', 'O' or 'N' was expected",
            ),
            (
                Wire::tag(b'D').u32(1).u8(b'N').u16(0).build(),
                5,
                "'K' or 'O' was expected",
            ),
            (
                Wire::tag(b'R')
                    .u32(1)
                    .string("s")
                    .string("t")
                    .u8(b'q')
                    .u16(0)
                    .build(),
                9,
                "unknown replica identity 'q'",
            ),
            (
                Wire::tag(b'O').u64(1).u8(b'a').build(),
                9,
                "origin name is not NUL-terminated",
            ),
            (
                Wire::tag(b'Y').u32(1).string("s").u8(0xFF).u8(0).build(),
                7,
                "type name is not valid UTF-8",
            ),
            (
                Wire::tag(b'M').u8(2).u64(1).string("p").sized(b"").build(),
                1,
                "logical message flags is 0x02",
            ),
            (
                Wire::tag(b'S').u32(1).u8(7).build(),
                5,
                "first-segment flag is 0x07",
            ),
            (
                Wire::tag(b'T').u32(u32::MAX).u8(0).u32(1).build(),
                10,
                "truncated id of a truncated relation",
            ),
            (
                Wire::tag(b'I').u32(1).u8(b'N').u16(u16::MAX).build(),
                8,
                "truncated tuple value kind",
            ),
            (
                Wire::tag(b'M')
                    .u8(0)
                    .u64(1)
                    .string("p")
                    .i32(i32::MAX)
                    .build(),
                16,
                "needs 2147483647 bytes, 0 left",
            ),
        ];
        for (bytes, offset, needle) in cases {
            let err = decode(&bytes).unwrap_err();
            assert!(err.what.contains(needle), "{err} (wanted {needle:?})");
            assert_eq!(err.offset, offset, "{err}");
        }
    }

    #[test]
    fn garbage_never_panics() {
        // A small deterministic generator: mutate real and hand-built messages, and feed pure noise.
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let seeds: Vec<Vec<u8>> = all_valid_messages().into_iter().map(|(b, _)| b).collect();
        for round in 0..20_000 {
            let mut bytes = if round % 4 == 0 {
                let len = (next() % 64) as usize;
                (0..len).map(|_| next() as u8).collect()
            } else {
                seeds[(next() % seeds.len() as u64) as usize].clone()
            };
            for _ in 0..=(next() % 4) {
                if let Some(len) = std::num::NonZeroUsize::new(bytes.len()) {
                    let at = (next() % len.get() as u64) as usize;
                    bytes[at] = next() as u8;
                }
            }
            let _ = decode(&bytes);
            let _ = decode_in_stream(&bytes);
        }
    }

    #[test]
    fn pg_timestamps_convert_to_unix() {
        assert_eq!(pg_time_to_unix_micros(0), Some(946_684_800_000_000));
        assert_eq!(pg_time_to_unix_micros(-PG_EPOCH_UNIX_MICROS), Some(0));
        assert_eq!(pg_time_to_unix_micros(i64::MAX), None);
    }

    #[test]
    fn relation_helpers() {
        let Ok(Message::Relation(relation)) = decode(&hand_built()[3].0) else {
            panic!("hand_built()[3] is a relation");
        };
        assert_eq!(relation.qualified_name(), "pg_catalog.pg_class");
        assert!(relation.columns[0].is_key());
        assert!(!relation.columns[1].is_key());
    }

    // Captured from PostgreSQL 15.18 with pg_logical_slot_peek_binary_changes(), proto_version 1
    // (publication on `outbox` for inserts, and one on `outbox` + `misc` for everything), and
    // proto_version 2 with streaming on for one large transaction (xid 739). See the tests below for
    // the SQL behind each.
    macro_rules! fixture {
        ($name:literal) => {
            (
                $name,
                include_bytes!(concat!("../../../tests/data/pgoutput/", $name)).as_slice(),
            )
        };
    }

    const FIXTURES: &[(&str, &[u8])] = &[
        fixture!("begin.bin"),
        fixture!("relation_outbox.bin"),
        fixture!("insert_outbox.bin"),
        fixture!("commit.bin"),
        fixture!("insert_null_payload.bin"),
        fixture!("message_transactional.bin"),
        fixture!("message_nontransactional.bin"),
        fixture!("origin.bin"),
        fixture!("type_mood.bin"),
        fixture!("relation_misc.bin"),
        fixture!("insert_misc_toast.bin"),
        fixture!("update_unchanged_toast.bin"),
        fixture!("delete_key.bin"),
        fixture!("truncate.bin"),
        fixture!("stream_start_first.bin"),
        fixture!("stream_start_next.bin"),
        fixture!("stream_relation.bin"),
        fixture!("stream_insert.bin"),
        fixture!("stream_message.bin"),
        fixture!("stream_stop.bin"),
        fixture!("stream_commit.bin"),
    ];

    fn fixture_is_in_stream(name: &str) -> bool {
        matches!(
            name,
            "stream_relation.bin" | "stream_insert.bin" | "stream_message.bin"
        )
    }

    fn fixture(name: &str) -> &'static [u8] {
        FIXTURES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, bytes)| *bytes)
            .unwrap_or_else(|| panic!("no fixture {name}"))
    }

    const OUTBOX_OID: u32 = 16384;
    const MISC_OID: u32 = 16397;
    const MOOD_OID: u32 = 16393;
    /// Commit time of the first captured transaction: 2026-11-21 22:03:05.119089 UTC.
    const FIRST_COMMIT_TIME: i64 = 848_613_785_119_089;

    fn outbox_relation() -> Relation {
        let column = |flags, name: &str, type_oid| RelationColumn {
            flags,
            name: name.into(),
            type_oid,
            type_modifier: -1,
        };
        Relation {
            id: OUTBOX_OID,
            namespace: "public".into(),
            name: "outbox".into(),
            replica_identity: ReplicaIdentity::Default,
            columns: vec![
                column(1, "id", 2950), // uuid
                column(0, "aggregatetype", 25),
                column(0, "aggregateid", 25),
                column(0, "type", 25),
                column(0, "payload", 3802),    // jsonb
                column(0, "created_at", 1184), // timestamptz
            ],
        }
    }

    #[test]
    fn real_single_insert_transaction() {
        // INSERT INTO outbox(id, aggregatetype, aggregateid, type, payload)
        //   VALUES ('11111111-…', 'order', '42', 'created', '{"total":10}');
        assert_eq!(
            decode(fixture("begin.bin")),
            Ok(Message::Begin {
                final_lsn: parse_lsn("0/1531B08").unwrap(),
                commit_time_us: FIRST_COMMIT_TIME,
                xid: 730,
            })
        );
        assert_eq!(
            decode(fixture("relation_outbox.bin")),
            Ok(Message::Relation(outbox_relation()))
        );
        assert_eq!(
            decode(fixture("insert_outbox.bin")),
            Ok(Message::Insert {
                relation_id: OUTBOX_OID,
                tuple: vec![
                    text("11111111-1111-1111-1111-111111111111"),
                    text("order"),
                    text("42"),
                    text("created"),
                    text("{\"total\": 10}"),
                    text("2026-11-21 22:03:05.118902+00"),
                ],
            })
        );
        let commit = decode(fixture("commit.bin")).unwrap();
        assert_eq!(
            commit,
            Message::Commit {
                flags: 0,
                commit_lsn: parse_lsn("0/1531B08").unwrap(),
                end_lsn: parse_lsn("0/1531B38").unwrap(),
                commit_time_us: FIRST_COMMIT_TIME,
            }
        );
        let Message::Commit {
            end_lsn,
            commit_time_us,
            ..
        } = commit
        else {
            unreachable!()
        };
        assert_eq!(lsn_to_string(end_lsn), "0/1531B38");
        // 2026-11-21T22:03:05.119089Z
        assert_eq!(
            pg_time_to_unix_micros(commit_time_us),
            Some(1_795_298_585_119_089)
        );
    }

    #[test]
    fn real_insert_with_null_column() {
        // Second row of a two-row transaction, payload NULL.
        let Ok(Message::Insert { relation_id, tuple }) = decode(fixture("insert_null_payload.bin"))
        else {
            panic!("not an insert");
        };
        assert_eq!(relation_id, OUTBOX_OID);
        assert_eq!(tuple.len(), 6);
        assert_eq!(tuple[0], text("33333333-3333-3333-3333-333333333333"));
        assert_eq!(tuple[3], text("paid"));
        assert_eq!(tuple[4], TupleValue::Null);
    }

    #[test]
    fn real_logical_messages() {
        // pg_logical_emit_message(true, 'outbox', '{"a":1}') inside BEGIN/COMMIT, then
        // pg_logical_emit_message(false, 'outbox', '{"b":2}') on its own.
        assert_eq!(
            decode(fixture("message_transactional.bin")),
            Ok(Message::Logical {
                transactional: true,
                lsn: parse_lsn("0/1531D18").unwrap(),
                prefix: "outbox".into(),
                content: b"{\"a\":1}".to_vec(),
            })
        );
        assert_eq!(
            decode(fixture("message_nontransactional.bin")),
            Ok(Message::Logical {
                transactional: false,
                lsn: parse_lsn("0/1531D88").unwrap(),
                prefix: "outbox".into(),
                content: b"{\"b\":2}".to_vec(),
            })
        );
    }

    #[test]
    fn real_origin() {
        // pg_replication_origin_session_setup('upstream_a');
        // pg_replication_origin_xact_setup('0/ABCDEF12', now()) before an insert.
        assert_eq!(
            decode(fixture("origin.bin")),
            Ok(Message::Origin {
                lsn: 0xABCD_EF12,
                name: "upstream_a".into(),
            })
        );
    }

    #[test]
    fn real_type_relation_and_toast() {
        // CREATE TYPE mood AS ENUM ('ok','meh');
        // CREATE TABLE misc(id int primary key, m mood, big text);  -- big: STORAGE EXTERNAL
        // INSERT INTO misc VALUES (1, 'ok', repeat('x', 5000)); UPDATE misc SET m = 'meh';
        assert_eq!(
            decode(fixture("type_mood.bin")),
            Ok(Message::Type {
                id: MOOD_OID,
                namespace: "public".into(),
                name: "mood".into(),
            })
        );
        let Ok(Message::Relation(misc)) = decode(fixture("relation_misc.bin")) else {
            panic!("not a relation");
        };
        assert_eq!(misc.qualified_name(), "public.misc");
        let layout: Vec<(&str, u32, bool)> = misc
            .columns
            .iter()
            .map(|c| (c.name.as_str(), c.type_oid, c.is_key()))
            .collect();
        assert_eq!(
            layout,
            [("id", 23, true), ("m", MOOD_OID, false), ("big", 25, false)]
        );
        assert_eq!(
            decode(fixture("insert_misc_toast.bin")),
            Ok(Message::Insert {
                relation_id: MISC_OID,
                tuple: vec![text("1"), text("ok"), TupleValue::Text(vec![b'x'; 5000])],
            })
        );
        assert_eq!(
            decode(fixture("update_unchanged_toast.bin")),
            Ok(Message::Update {
                relation_id: MISC_OID,
                old: None,
                new: vec![text("1"), text("meh"), TupleValue::UnchangedToast],
            })
        );
    }

    #[test]
    fn real_delete_and_truncate() {
        // DELETE FROM outbox WHERE id = '11111111-…'; TRUNCATE misc;
        assert_eq!(
            decode(fixture("delete_key.bin")),
            Ok(Message::Delete {
                relation_id: OUTBOX_OID,
                old: OldTuple::Key(vec![
                    text("11111111-1111-1111-1111-111111111111"),
                    TupleValue::Null,
                    TupleValue::Null,
                    TupleValue::Null,
                    TupleValue::Null,
                    TupleValue::Null,
                ]),
            })
        );
        assert_eq!(
            decode(fixture("truncate.bin")),
            Ok(Message::Truncate {
                options: 0,
                relation_ids: vec![MISC_OID],
            })
        );
    }

    #[test]
    fn real_streamed_transaction() {
        // 600 inserts plus pg_logical_emit_message(true, 'outbox', 'in-stream') in one transaction,
        // decoded with proto_version 2, streaming on, logical_decoding_work_mem = 64kB.
        assert_eq!(
            decode(fixture("stream_start_first.bin")),
            Ok(Message::StreamStart {
                xid: 739,
                first_segment: true,
            })
        );
        assert_eq!(
            decode(fixture("stream_start_next.bin")),
            Ok(Message::StreamStart {
                xid: 739,
                first_segment: false,
            })
        );
        assert_eq!(
            decode_in_stream(fixture("stream_relation.bin")),
            Ok(Streamed {
                xid: 739,
                message: Message::Relation(outbox_relation()),
            })
        );
        let Ok(Streamed {
            xid: 739,
            message: Message::Insert { relation_id, tuple },
        }) = decode_in_stream(fixture("stream_insert.bin"))
        else {
            panic!("not a streamed insert of xid 739");
        };
        assert_eq!(relation_id, OUTBOX_OID);
        assert_eq!(tuple[1], text("bulk"));
        assert_eq!(tuple[2], text("1"));
        assert_eq!(
            decode_in_stream(fixture("stream_message.bin")),
            Ok(Streamed {
                xid: 739,
                message: Message::Logical {
                    transactional: true,
                    lsn: parse_lsn("0/15704F8").unwrap(),
                    prefix: "outbox".into(),
                    content: b"in-stream".to_vec(),
                },
            })
        );
        assert_eq!(decode(fixture("stream_stop.bin")), Ok(Message::StreamStop));
        assert_eq!(
            decode(fixture("stream_commit.bin")),
            Ok(Message::StreamCommit {
                xid: 739,
                flags: 0,
                commit_lsn: parse_lsn("0/15704F8").unwrap(),
                end_lsn: parse_lsn("0/1570528").unwrap(),
                commit_time_us: 0x0003_03CF_4C12_BED5,
            })
        );
    }

    #[test]
    fn control_messages_are_rejected_inside_a_stream() {
        // Framing is the caller's to track (StreamStart .. StreamStop): a data message decoded with the
        // wrong framing can still parse, but a control message inside a stream is always an error.
        for name in ["begin.bin", "commit.bin", "origin.bin", "stream_commit.bin"] {
            let err = decode_in_stream(fixture(name)).unwrap_err();
            assert!(err.what.contains("cannot appear inside a stream"), "{err}");
        }
    }
}
