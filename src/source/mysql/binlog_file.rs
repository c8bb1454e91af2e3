//! Binlog files as a source: the same decoding, transaction grouping, filtering and routing as the live
//! stream (one [`Decoder`] for both); only the byte supply differs.
//!
//! For when the server purged the binlogs a checkpoint needs but a backup still has them, or to audit
//! what a file holds. Every event's length is checked against the file before it is parsed, compressed
//! transactions (MySQL 8 `TRANSACTION_PAYLOAD`) are expanded here with their size checked, and any event
//! that cannot be read ends the replay with the file and offset: a damaged file is never skipped over.
//! Files from servers with `binlog_row_metadata=MINIMAL` carry no column names; their columns are
//! called `@0`, `@1`, … (route on those names).

use std::collections::{HashSet, VecDeque};
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mysql_common::binlog::consts::BinlogVersion;
use mysql_common::binlog::events::{Event, TransactionPayloadEvent};
use mysql_common::binlog::EventStreamReader;

use super::columns::TableColumns;
use super::decoder::{Decoder, Step};
use super::event_types;
use super::event_types as et;
use super::position::BinlogPosition;
use crate::error::{Error, Result};
use crate::source::{Change, Ignored, Position};

const MAGIC: [u8; 4] = [0xfe, b'b', b'i', b'n'];
const HEADER_LEN: usize = 19;
/// Refuse decompressed transactions larger than this (a corrupt size field must not exhaust memory).
const MAX_PAYLOAD: u64 = 1 << 30;

struct OpenFile {
    path: PathBuf,
    reader: BufReader<File>,
    offset: u64,
    len: u64,
}

pub struct BinlogFileSource {
    files: Vec<PathBuf>,
    next_file: usize,
    current: Option<OpenFile>,
    esr: EventStreamReader,
    inner: VecDeque<Event>,
    decoder: Decoder,
    buffer: VecDeque<Change>,
    /// Skip to this offset in the first file (after its format description).
    skip_to: Option<u64>,
    warned: HashSet<Arc<str>>,
    exhausted: bool,
    /// File and offset of the last event read, for error messages.
    last_event: (PathBuf, u64),
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

impl BinlogFileSource {
    /// Reads `files` in order. With `from` (`FILE:POS`), files before `FILE` are skipped and reading
    /// starts at `POS` of it.
    pub fn open(
        files: Vec<PathBuf>,
        tables: impl IntoIterator<Item = String>,
        from: Option<&Position>,
    ) -> Result<BinlogFileSource> {
        if files.is_empty() {
            return Err(Error::config("no binlog file given")
                .remedy("pass --binlog-file PATH (repeatable)"));
        }
        let mut files = files;
        let mut skip_to = None;
        let mut start_pos = 4;
        if let Some(from) = from {
            let from = from.binlog()?;
            start_pos = from.pos;
            let index = files
                .iter()
                .position(|f| file_name(f) == from.file)
                .ok_or_else(|| {
                    Error::config(format!(
                        "--from names file {}, which is not among the files given",
                        from.file
                    ))
                    .remedy("pass that file with --binlog-file, or a position in one of the files")
                })?;
            files.drain(..index);
            skip_to = Some(from.pos);
        }
        // Where this source starts is `--from` itself: a replay retried after a broker hiccup
        // resumes from its scratch checkpoint, which starts out as this.
        let start = BinlogPosition {
            file: file_name(&files[0]),
            pos: start_pos,
            gtid: None,
            mysql_gtids: None,
        };
        Ok(BinlogFileSource {
            files,
            next_file: 0,
            current: None,
            esr: EventStreamReader::new(BinlogVersion::Version4),
            inner: VecDeque::new(),
            decoder: Decoder::new(start, tables),
            buffer: VecDeque::new(),
            skip_to,
            warned: HashSet::new(),
            exhausted: false,
            last_event: (PathBuf::new(), 0),
        })
    }

    pub fn ignored(&self) -> Ignored {
        self.decoder.ignored()
    }

    pub fn start(&self) -> Position {
        self.decoder.boundary().to_position()
    }

    /// The next change; [`Change::Exhausted`] once every file was read.
    pub fn next_change(&mut self) -> Result<Change> {
        loop {
            if let Some(change) = self.buffer.pop_front() {
                return Ok(change);
            }
            if self.exhausted {
                return Ok(Change::Exhausted);
            }
            let Some(event) = self.read_event()? else {
                self.exhausted = true;
                continue;
            };
            // Row decoding is third-party code fed untrusted bytes: a panic there is an error too.
            let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.decoder.on_event(&event, &mut self.buffer)
            }))
            .unwrap_or_else(|_| Err(Error::source("malformed event (the decoder gave up)")));
            let step = decoded.map_err(|e| {
                let (path, at) = &self.last_event;
                Error::source(format!(
                    "{} (event at offset {at}): {}",
                    path.display(),
                    e.message()
                ))
                .remedy(
                    e.remedy_text()
                        .unwrap_or("replay stops here rather than skip events")
                        .to_string(),
                )
            })?;
            match step {
                Step::Continue => {}
                Step::NeedColumns {
                    table_id,
                    table,
                    tme,
                } => {
                    let (columns, named) =
                        TableColumns::from_metadata_or_positions(table.clone(), *tme)
                            .map_err(|e| Error::source(format!("table map of {table}: {e}")))?;
                    if !named && self.warned.insert(table.clone()) {
                        tracing::warn!(%table, "the file carries no column names (binlog_row_metadata=MINIMAL): columns are named @0, @1, …");
                    }
                    self.decoder.map_table(table_id, Arc::new(columns));
                }
            }
        }
    }

    fn corrupt(path: &Path, offset: u64, what: impl std::fmt::Display) -> Error {
        Error::source(format!("{}: cannot read the event at offset {offset}: {what}", path.display()))
            .remedy("the file is truncated or damaged; replay stops here rather than skip events (use --to to stop before this offset)")
    }

    fn read_event(&mut self) -> Result<Option<Event>> {
        if let Some(event) = self.inner.pop_front() {
            return Ok(Some(event));
        }
        loop {
            let Some(f) = self.current.as_mut() else {
                let Some(path) = self.files.get(self.next_file).cloned() else {
                    return Ok(None);
                };
                self.next_file += 1;
                self.current = Some(open(&path)?);
                self.esr = EventStreamReader::new(BinlogVersion::Version4);
                continue;
            };
            if f.offset == f.len {
                self.current = None;
                continue;
            }
            let at = f.offset;
            self.last_event = (f.path.clone(), at);
            let remaining = f.len - at;
            if remaining < HEADER_LEN as u64 {
                return Err(Self::corrupt(
                    &f.path,
                    at,
                    format!("the file ends {remaining} bytes into an event header"),
                ));
            }
            let mut bytes = vec![0u8; HEADER_LEN];
            f.reader
                .read_exact(&mut bytes)
                .map_err(|e| Self::corrupt(&f.path, at, e))?;
            let size = u32::from_le_bytes(bytes[9..13].try_into().expect("4 bytes")) as u64;
            let event_type = bytes[4];
            let min = if event_type == event_types::FORMAT_DESCRIPTION {
                HEADER_LEN + 5
            } else {
                HEADER_LEN
            };
            if size < min as u64 {
                return Err(Self::corrupt(
                    &f.path,
                    at,
                    format!("event length {size} is shorter than its header"),
                ));
            }
            if size > remaining {
                return Err(Self::corrupt(&f.path, at, format!("the event claims {size} bytes but the file has {remaining} left (truncated)")));
            }
            bytes.resize(size as usize, 0);
            f.reader
                .read_exact(&mut bytes[HEADER_LEN..])
                .map_err(|e| Self::corrupt(&f.path, at, e))?;
            f.offset += size;
            let checksummed = event_type != event_types::FORMAT_DESCRIPTION
                && matches!(
                    self.esr.get_fde().footer().get_checksum_alg(),
                    Ok(Some(
                        mysql_common::binlog::consts::BinlogChecksumAlg::BINLOG_CHECKSUM_ALG_CRC32
                    ))
                );
            if checksummed && size < (HEADER_LEN + 4) as u64 {
                return Err(Self::corrupt(
                    &f.path,
                    at,
                    "event too short for its checksum",
                ));
            }
            let event =
                parse(&mut self.esr, &bytes, false).map_err(|e| Self::corrupt(&f.path, at, e))?;
            if let Some(skip) = self.skip_to.take() {
                if event_type == event_types::FORMAT_DESCRIPTION && f.offset < skip {
                    // Keep the format description, then jump to the requested offset.
                    f.reader
                        .seek_relative((skip - f.offset) as i64)
                        .map_err(|e| Self::corrupt(&f.path, at, e))?;
                    f.offset = skip;
                } else {
                    self.skip_to = Some(skip);
                }
            }
            if event_type == et::TRANSACTION_PAYLOAD {
                let inner = expand_payload(&mut self.esr, &event)
                    .map_err(|e| Self::corrupt(&f.path, at, e))?;
                self.inner.extend(inner);
            }
            return Ok(Some(event));
        }
    }
}

fn open(path: &Path) -> Result<OpenFile> {
    let file = File::open(path).map_err(|e| {
        Error::config(format!("cannot open binlog file {}: {e}", path.display()))
            .remedy("check the path and permissions")
    })?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut magic = [0u8; 4];
    if len < 4 || reader.read_exact(&mut magic).is_err() || magic != MAGIC {
        return Err(Error::source(format!(
            "{} is not a binlog file (no binlog magic at offset 0)",
            path.display()
        ))
        .remedy("pass binary log files as written by the server (mysql-bin.000001, …)"));
    }
    Ok(OpenFile {
        path: path.to_path_buf(),
        reader,
        offset: 4,
        len,
    })
}

/// One event from exactly its bytes. The parser is third-party code fed untrusted input, so a panic
/// inside it is turned into an error too.
fn parse(
    esr: &mut EventStreamReader,
    bytes: &[u8],
    decompressed: bool,
) -> std::result::Result<Event, String> {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if decompressed {
            esr.read_decompressed(bytes)
        } else {
            esr.read(bytes)
        }
    }));
    match result {
        Ok(Ok(Some(event))) => Ok(event),
        Ok(Ok(None)) => Err("empty event".into()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("malformed event".into()),
    }
}

/// The events inside a compressed transaction, each length-checked like a file's.
fn expand_payload(
    esr: &mut EventStreamReader,
    event: &Event,
) -> std::result::Result<Vec<Event>, String> {
    let payload: TransactionPayloadEvent<'_> = event.read_event().map_err(|e| e.to_string())?;
    let size = payload.uncompressed_size();
    if size > MAX_PAYLOAD {
        return Err(format!(
            "compressed transaction claims {size} bytes uncompressed"
        ));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    payload
        .decompressed()
        .map_err(|e| e.to_string())?
        .take(size + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot decompress the transaction: {e}"))?;
    if bytes.len() as u64 != size {
        return Err(format!(
            "the transaction decompressed to {} bytes, not the {size} its header says",
            bytes.len()
        ));
    }
    let mut events = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let header = bytes
            .get(at..at + HEADER_LEN)
            .ok_or("a compressed event header is cut off")?;
        let len = u32::from_le_bytes(header[9..13].try_into().expect("4 bytes")) as usize;
        if len < HEADER_LEN || at + len > bytes.len() {
            return Err(format!(
                "a compressed event claims {len} bytes at {at} of {}",
                bytes.len()
            ));
        }
        events.push(parse(esr, &bytes[at..at + len], true)?);
        at += len;
    }
    Ok(events)
}
