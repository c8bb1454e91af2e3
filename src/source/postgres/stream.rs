//! The replication connection, read where its rows are decoded.
//!
//! ## Why we speak this part of the protocol ourselves
//! A replication client library reads the socket in a task of its own and hands every message over
//! a channel: one task wake-up per message before our code sees it (three per one-row transaction:
//! Begin, Insert, Commit). On machines where a wake-up costs microseconds that was most of the
//! Postgres path's CPU (see BENCHMARKS.md). Here the source's own task reads the socket into one
//! buffer and takes every whole message in it without waiting, so a read of many messages costs one
//! wake-up. The part of the protocol a logical replication stream needs is small:
//!
//! - startup with `replication=database`, then authentication: cleartext, MD5 or SCRAM-SHA-256 (the
//!   `postgres-protocol` crate that tokio-postgres uses does the message formats and SCRAM);
//! - `IDENTIFY_SYSTEM` (the cluster's system identifier names the checkpoint's server);
//! - `START_REPLICATION SLOT … LOGICAL … (proto_version '1', publication_names …, messages 'true')`;
//! - then CopyData frames: XLogData (`w`) and keepalives (`k`) from the server, and standby status
//!   updates (`r`) from us.
//!
//! ## Status updates
//! A small task of its own writes the standby status every second (and at once when a keepalive
//! asks for a reply): `write`, `flush` and `apply` are all the newest position the local checkpoint
//! holds durably (asked of [`Durable`]), so the slot never moves past what a restart needs, and a
//! synchronous-standby setup never takes a change as written before it is in Kafka. Because it never waits for the reader, a pipeline held back by Kafka still
//! answers the walsender within `wal_sender_timeout`.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, BufMut, BytesMut};
use fallible_iterator::FallibleIterator;
use postgres_protocol::authentication::{md5_hash, sasl};
use postgres_protocol::message::{backend, frontend};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::io::{ReadHalf, WriteHalf};
use tokio::sync::Notify;

use super::control::{refuses_plain_text, transient_sqlstate, ConnInfo};
use super::lsn::{lsn_to_string, parse_lsn};
use super::socket::{self, Socket};
use crate::error::{Error, Result};
use crate::source::tls::connection_lost;
use crate::source::Durable;

/// Bytes asked of the socket per read (many small messages in one).
const READ_CHUNK: usize = 128 * 1024;
/// The largest message accepted: a single change larger than this stops outboxd.
const MAX_MESSAGE: usize = 512 * 1024 * 1024;
/// What `IDENTIFY_SYSTEM` says about the server.
pub struct System {
    /// The cluster's system identifier (the same on its physical standbys).
    pub id: String,
    /// The server's timeline: a promotion starts a new one.
    pub timeline: u32,
}

/// The largest message accepted before streaming starts (startup, login, IDENTIFY_SYSTEM).
const HANDSHAKE_MESSAGE: usize = 1024 * 1024;
/// A read buffer grown past this for one large message is given back once it is empty again.
const KEEP_BUFFER: usize = 4 * 1024 * 1024;
/// How often the standby status is sent without being asked.
const STATUS_INTERVAL: Duration = Duration::from_secs(1);
/// Microseconds from the Unix epoch to the Postgres epoch (2000-01-01).
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

/// A connection that passed startup and authentication and waits for commands.
pub(super) struct Connection {
    socket: Socket,
    buf: BytesMut,
    shown: String,
}

/// One message of a running stream.
pub(super) enum Frame<'a> {
    /// A pgoutput message.
    XLogData { data: &'a [u8] },
    /// Nothing to send: everything before `wal_end` was sent.
    KeepAlive { wal_end: u64 },
}

/// A running logical replication stream.
pub(super) struct ReplicationStream {
    read: ReadHalf<Socket>,
    buf: BytesMut,
    /// Bytes at the front of `buf` that belong to the frame returned last.
    consumed: usize,
    /// The socket was read since [`ReplicationStream::took_read`] was last asked.
    fresh: bool,
    /// Wakes the status task when a keepalive asks for a reply.
    reply: Arc<Notify>,
    status: tokio::task::JoinHandle<()>,
    shown: String,
}

impl Drop for ReplicationStream {
    fn drop(&mut self) {
        self.status.abort();
    }
}

/// The server closed or broke the connection (or, right after the handshake, refused our client
/// certificate with a TLS alert: definite).
fn io_error(shown: &str, e: std::io::Error) -> Error {
    if let Some(refused) = crate::source::tls::alert_error(shown, &e.to_string()) {
        return refused.caused_by(e);
    }
    Error::source(format!("{shown}: the replication connection failed: {e}"))
        .remedy("outboxd reconnects by itself")
        .transient()
        .caused_by(e)
}

fn protocol_error(shown: &str, what: String) -> Error {
    Error::source(format!(
        "{shown}: unexpected replication protocol data: {what}"
    ))
    .remedy("this is a bug or an unsupported server; outboxd stops rather than guess. Report it with this line")
}

/// The SQLSTATE code and message of an ErrorResponse body (`type, text\0` pairs, then `\0`).
fn error_fields(body: &[u8]) -> (String, String) {
    let (mut code, mut message) = (String::new(), String::new());
    let mut rest = body;
    while let Some((&kind, tail)) = rest.split_first() {
        if kind == 0 {
            break;
        }
        let end = tail.iter().position(|&b| b == 0).unwrap_or(tail.len());
        let value = String::from_utf8_lossy(&tail[..end]).into_owned();
        match kind {
            b'C' => code = value,
            b'M' => message = value,
            _ => {}
        }
        rest = tail.get(end + 1..).unwrap_or_default();
    }
    (code, message)
}

/// An ErrorResponse: a reconnect cures some (the slot still held by a previous connection,
/// shutdown, connection trouble); others (a missing publication, a dropped slot, privileges, a
/// refused login) stop outboxd with the server's own message.
fn server_error(shown: &str, body: &[u8]) -> Error {
    let (code, message) = error_fields(body);
    let text = format!("{shown}: {message} (SQLSTATE {code})");
    if code == "28000" && refuses_plain_text(&message) {
        return Error::source(format!(
            "{shown} refused the login: {message} (SQLSTATE {code})"
        ))
        .remedy(crate::source::tls::NEEDS_TLS_REMEDY);
    }
    if code == "28P01" || code == "28000" {
        return Error::source(format!("{shown} refused the login: {message} (SQLSTATE {code})"))
            .remedy("check the user and password; the user needs the REPLICATION attribute and a pg_hba.conf 'replication' entry");
    }
    if transient_sqlstate(&code) {
        return Error::source(text)
            .remedy("outboxd reconnects by itself")
            .transient();
    }
    Error::source(text)
        .remedy("fix what the server reports (slot, publication, privileges), then restart outboxd")
}

impl Connection {
    /// Connects to `info`'s server as a replication connection and logs in.
    pub async fn open(info: &ConnInfo) -> Result<Connection> {
        let shown = info.shown.clone();
        let (socket, _) = socket::connect(info).await?;
        let mut conn = Connection {
            socket,
            buf: BytesMut::with_capacity(8 * 1024),
            shown,
        };
        let mut out = BytesMut::new();
        frontend::startup_message(
            [
                ("user", info.user.as_str()),
                ("database", info.dbname.as_str()),
                ("replication", "database"),
                ("client_encoding", "UTF8"),
                ("application_name", info.application_name.as_str()),
            ],
            &mut out,
        )
        .map_err(|e| protocol_error(&conn.shown, e.to_string()))?;
        let login = async {
            conn.write(&out).await?;
            conn.authenticate(info).await
        };
        if let Err(e) = login.await {
            if connection_lost(&e) {
                if let Some(refused) = socket::client_cert_refused(info).await {
                    return Err(refused);
                }
            }
            return Err(e);
        }
        Ok(conn)
    }

    /// Says goodbye (Terminate) and closes; for connections opened only to be tested.
    pub async fn close(mut self) {
        let mut out = BytesMut::new();
        frontend::terminate(&mut out);
        let _ = self.write(&out).await;
        let _ = self.socket.shutdown().await;
    }

    async fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.socket
            .write_all(bytes)
            .await
            .map_err(|e| io_error(&self.shown, e))
    }

    /// The next whole message (reading as needed). An ErrorResponse is returned as the error it
    /// reports.
    async fn message(&mut self) -> Result<backend::Message> {
        loop {
            if let Some((tag, len)) = header(&self.buf) {
                if len > HANDSHAKE_MESSAGE {
                    return Err(protocol_error(
                        &self.shown,
                        format!("a {len}-byte message (tag {tag}) during the handshake"),
                    ));
                }
            }
            if let Some((b'E', len)) = header(&self.buf) {
                if self.buf.len() > len && len >= 4 {
                    let error = server_error(&self.shown, &self.buf[5..1 + len]);
                    self.buf.advance(1 + len);
                    return Err(error);
                }
            }
            match backend::Message::parse(&mut self.buf) {
                Ok(Some(message)) => return Ok(message),
                Ok(None) => {}
                Err(e) => return Err(protocol_error(&self.shown, e.to_string())),
            }
            read_more(&mut self.socket, &mut self.buf, &self.shown).await?;
        }
    }

    /// Answers the server's authentication request until it says Ok, then waits for ReadyForQuery.
    async fn authenticate(&mut self, info: &ConnInfo) -> Result<()> {
        let shown = self.shown.clone();
        let password = || {
            info.password.clone().ok_or_else(|| {
                Error::source(format!("{shown} asks for a password, and none is configured"))
                    .remedy("set source.password_file or OUTBOXD_SOURCE__PASSWORD (or put it in source.url)")
            })
        };
        let mut scram: Option<sasl::ScramSha256> = None;
        // Once SCRAM started, the server must prove it knows the password (SASLFinal) before Ok,
        // and may not switch to a method that would send the password itself.
        let mut sasl_started = false;
        let mut server_proven = false;
        let downgrade = |shown: &str| {
            Error::source(format!(
                "{shown} started SCRAM authentication, then asked for a weaker method or skipped its proof"
            ))
            .remedy("check that source.url points at the intended server (not a proxy in between)")
        };
        loop {
            let mut out = BytesMut::new();
            let encode = |e: std::io::Error| protocol_error(&shown, e.to_string());
            match self.message().await? {
                backend::Message::AuthenticationOk => {
                    if sasl_started && !server_proven {
                        return Err(downgrade(&shown));
                    }
                }
                backend::Message::AuthenticationCleartextPassword
                | backend::Message::AuthenticationMd5Password(_)
                    if sasl_started =>
                {
                    return Err(downgrade(&shown));
                }
                backend::Message::AuthenticationCleartextPassword => {
                    frontend::password_message(password()?.as_bytes(), &mut out).map_err(encode)?;
                }
                backend::Message::AuthenticationMd5Password(body) => {
                    let hash = md5_hash(info.user.as_bytes(), password()?.as_bytes(), body.salt());
                    frontend::password_message(hash.as_bytes(), &mut out).map_err(encode)?;
                }
                backend::Message::AuthenticationSasl(body) => {
                    let mut offered = Vec::new();
                    let mut mechanisms = body.mechanisms();
                    while let Ok(Some(m)) = mechanisms.next() {
                        offered.push(m.to_string());
                    }
                    if !offered.iter().any(|m| m == sasl::SCRAM_SHA_256) {
                        return Err(Error::source(format!(
                            "{} offers only SASL mechanisms {offered:?}",
                            self.shown
                        ))
                        .remedy("allow scram-sha-256 (or md5/password) for the outboxd user in pg_hba.conf"));
                    }
                    let client = sasl::ScramSha256::new(
                        password()?.as_bytes(),
                        sasl::ChannelBinding::unsupported(),
                    );
                    frontend::sasl_initial_response(
                        sasl::SCRAM_SHA_256,
                        client.message(),
                        &mut out,
                    )
                    .map_err(encode)?;
                    scram = Some(client);
                    sasl_started = true;
                }
                backend::Message::AuthenticationSaslContinue(body) => {
                    let client = scram.as_mut().ok_or_else(|| {
                        protocol_error(&self.shown, "SASL continue before SASL start".into())
                    })?;
                    client.update(body.data()).map_err(|e| {
                        Error::source(format!("{} refused the login: {e}", self.shown))
                            .remedy("check the user and password")
                    })?;
                    frontend::sasl_response(client.message(), &mut out).map_err(encode)?;
                }
                backend::Message::AuthenticationSaslFinal(body) => {
                    let client = scram.as_mut().ok_or_else(|| {
                        protocol_error(&self.shown, "SASL final before SASL start".into())
                    })?;
                    client.finish(body.data()).map_err(|e| {
                        Error::source(format!(
                            "{}: the server's SCRAM proof is wrong: {e}",
                            self.shown
                        ))
                        .remedy("check that source.url points at the intended server")
                    })?;
                    server_proven = true;
                }
                backend::Message::ReadyForQuery(_) => return Ok(()),
                backend::Message::ParameterStatus(_)
                | backend::Message::BackendKeyData(_)
                | backend::Message::NoticeResponse(_) => {}
                _ => {
                    return Err(Error::source(format!(
                        "{} asks for an authentication method outboxd does not speak",
                        self.shown
                    ))
                    .remedy(
                        "allow scram-sha-256, md5 or password for the outboxd user in pg_hba.conf",
                    ))
                }
            }
            if !out.is_empty() {
                self.write(&out).await?;
            }
        }
    }

    /// `IDENTIFY_SYSTEM`: the cluster's system identifier and the server's timeline.
    pub async fn identify_system(&mut self) -> Result<System> {
        let row = self.one_row("IDENTIFY_SYSTEM").await?;
        let id = row.first().cloned().flatten();
        let timeline = row
            .get(1)
            .cloned()
            .flatten()
            .and_then(|t| String::from_utf8_lossy(&t).parse().ok());
        match (id, timeline) {
            (Some(id), Some(timeline)) => Ok(System {
                id: String::from_utf8_lossy(&id).into_owned(),
                timeline,
            }),
            _ => Err(protocol_error(
                &self.shown,
                "IDENTIFY_SYSTEM returned no system identifier and timeline".into(),
            )),
        }
    }

    /// `TIMELINE_HISTORY timeline`: the history file's text (`parent\tswitch point\treason` lines).
    pub async fn timeline_history(&mut self, timeline: u32) -> Result<String> {
        let row = self
            .one_row(&format!("TIMELINE_HISTORY {timeline}"))
            .await?;
        let content = row.get(1).cloned().flatten().ok_or_else(|| {
            protocol_error(&self.shown, "TIMELINE_HISTORY returned no content".into())
        })?;
        Ok(String::from_utf8_lossy(&content).into_owned())
    }

    /// The fields of the one row a replication command answers with (raw bytes; `None` for NULL).
    async fn one_row(&mut self, command: &str) -> Result<Vec<Option<Vec<u8>>>> {
        let mut out = BytesMut::new();
        frontend::query(command, &mut out)
            .map_err(|e| protocol_error(&self.shown, e.to_string()))?;
        self.write(&out).await?;
        let mut fields = None;
        loop {
            match self.message().await? {
                backend::Message::DataRow(row) => {
                    let mut values = Vec::new();
                    let mut ranges = row.ranges();
                    while let Ok(Some(range)) = ranges.next() {
                        values.push(range.map(|r| row.buffer()[r].to_vec()));
                    }
                    fields = Some(values);
                }
                backend::Message::ReadyForQuery(_) => break,
                _ => {}
            }
        }
        fields.ok_or_else(|| protocol_error(&self.shown, format!("{command} returned no row")))
    }

    /// `CREATE_REPLICATION_SLOT … EXPORT_SNAPSHOT`: the new slot's consistent point and the name of
    /// the snapshot it exports (every transaction committed before that point, none after), which
    /// another connection can import (`SET TRANSACTION SNAPSHOT`) while this one stays open and idle.
    /// With `failover` (17+ primaries), a failover slot.
    pub async fn create_slot_exporting(
        &mut self,
        slot: &str,
        failover: bool,
    ) -> Result<(u64, String)> {
        let mut out = BytesMut::new();
        // The option list came in 15; FAILOVER in 17.
        let options = if failover {
            "(SNAPSHOT 'export', FAILOVER true)"
        } else {
            "EXPORT_SNAPSHOT"
        };
        frontend::query(
            &format!(
                "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput {options}",
                quote_ident(slot)
            ),
            &mut out,
        )
        .map_err(|e| protocol_error(&self.shown, e.to_string()))?;
        self.write(&out).await?;
        let mut created = None;
        loop {
            match self.message().await? {
                backend::Message::DataRow(row) => {
                    let buffer = row.buffer();
                    let fields: Vec<Option<String>> = row
                        .ranges()
                        .map(|r| Ok(r.map(|r| String::from_utf8_lossy(&buffer[r]).into_owned())))
                        .collect()
                        .map_err(|e| protocol_error(&self.shown, e.to_string()))?;
                    if let [_, Some(point), Some(snapshot), ..] = fields.as_slice() {
                        created = parse_lsn(point).map(|lsn| (lsn, snapshot.clone()));
                    }
                }
                backend::Message::ReadyForQuery(_) => break,
                _ => {}
            }
        }
        created.ok_or_else(|| {
            protocol_error(
                &self.shown,
                "CREATE_REPLICATION_SLOT returned no consistent point and snapshot".into(),
            )
        })
    }

    /// Starts streaming `slot` from `start` for `publication`; the stream confirms to the server
    /// what `durable` says is durable.
    pub async fn start(
        mut self,
        slot: &str,
        publication: &str,
        start: u64,
        durable: Durable,
    ) -> Result<ReplicationStream> {
        let sql = format!(
            "START_REPLICATION SLOT {} LOGICAL {} (proto_version '1', publication_names '{}', messages 'true')",
            quote_ident(slot),
            lsn_to_string(start),
            quote_ident(publication).replace('\'', "''"),
        );
        let mut out = BytesMut::new();
        frontend::query(&sql, &mut out).map_err(|e| protocol_error(&self.shown, e.to_string()))?;
        self.write(&out).await?;
        loop {
            // CopyBothResponse ('W') is not among postgres-protocol's messages: read its header.
            if let Some((tag, len)) = header(&self.buf) {
                if len < 4 {
                    return Err(protocol_error(&self.shown, format!("message length {len}")));
                }
                if self.buf.len() > len {
                    match tag {
                        b'W' => {
                            self.buf.advance(1 + len);
                            break;
                        }
                        b'E' => return Err(server_error(&self.shown, &self.buf[5..1 + len])),
                        _ => {
                            self.buf.advance(1 + len);
                            continue;
                        }
                    }
                }
            }
            read_more(&mut self.socket, &mut self.buf, &self.shown).await?;
        }
        Ok(ReplicationStream::streaming(
            self.socket,
            self.buf,
            start,
            durable,
            self.shown,
        ))
    }
}

/// Reads what the socket has into `buf`; the end of the stream is an error (the server never
/// closes a healthy connection first).
async fn read_more(
    socket: &mut (impl tokio::io::AsyncRead + Unpin),
    buf: &mut BytesMut,
    shown: &str,
) -> Result<()> {
    let read = socket.read_buf(buf).await.map_err(|e| io_error(shown, e))?;
    if read == 0 {
        return Err(io_error(shown, std::io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(())
}

/// A message header at the front of `buf`: (tag, length without the tag byte).
fn header(buf: &[u8]) -> Option<(u8, usize)> {
    if buf.len() < 5 {
        return None;
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    Some((buf[0], len))
}

/// A replication-command identifier, double-quoted.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

impl ReplicationStream {
    /// The stream on `socket` once the server answered START_REPLICATION (`buf` holds what was
    /// read past that answer); starts the status task.
    fn streaming(
        socket: Socket,
        buf: BytesMut,
        start: u64,
        durable: Durable,
        shown: String,
    ) -> ReplicationStream {
        // Bytes read with the server's answer to START_REPLICATION count as a read.
        let fresh = !buf.is_empty();
        let (read, write) = tokio::io::split(socket);
        let reply = Arc::new(Notify::new());
        let status = tokio::spawn(send_status(write, reply.clone(), durable, start));
        ReplicationStream {
            read,
            buf,
            consumed: 0,
            fresh,
            reply,
            status,
            shown,
        }
    }

    /// The next XLogData or keepalive. Cancel-safe: a message is taken only when it is returned,
    /// and the bytes read so far stay in the buffer.
    ///
    /// A returned frame counts as taken: the caller must not go on reading after failing to handle
    /// one (every error ends the session, which drops the stream).
    pub async fn next(&mut self) -> Result<Frame<'_>> {
        if self.consumed > 0 {
            self.buf.advance(self.consumed);
            self.consumed = 0;
            if self.buf.is_empty() && self.buf.capacity() > KEEP_BUFFER {
                self.buf = BytesMut::with_capacity(READ_CHUNK);
            }
        }
        // (kind, start, end, wal_end) of the frame found.
        let (is_data, start, end, wal_end) = loop {
            let Some((tag, len)) = header(&self.buf) else {
                self.fill(5).await?;
                continue;
            };
            if !(4..=MAX_MESSAGE).contains(&len) {
                return Err(if len > MAX_MESSAGE {
                    Error::source(format!(
                        "{}: a replication message of {len} bytes exceeds 512 MiB",
                        self.shown
                    ))
                    .remedy("a single change exceeds 512 MiB; outboxd stops rather than skip it")
                } else {
                    protocol_error(&self.shown, format!("message length {len}"))
                });
            }
            if self.buf.len() < 1 + len {
                self.fill(1 + len).await?;
                continue;
            }
            let body = &self.buf[5..1 + len];
            match (tag, body.first()) {
                (b'd', Some(b'w')) if body.len() >= 25 => {
                    break (true, 5 + 25, 1 + len, u64_at(body, 9));
                }
                (b'd', Some(b'k')) if body.len() >= 18 => {
                    if body[17] != 0 {
                        self.reply.notify_one();
                    }
                    break (false, 0, 1 + len, u64_at(body, 1));
                }
                (b'd', _) => {
                    return Err(protocol_error(
                        &self.shown,
                        format!(
                            "CopyData of {} bytes starting {:?}",
                            body.len(),
                            body.first()
                        ),
                    ))
                }
                (b'E', _) => return Err(server_error(&self.shown, body)),
                (b'c', _) => {
                    return Err(Error::source(format!(
                        "{}: the server ended the replication stream",
                        self.shown
                    ))
                    .remedy("outboxd reconnects by itself")
                    .transient())
                }
                // Notices and anything else the server may interleave.
                _ => self.buf.advance(1 + len),
            }
        };
        self.consumed = end;
        Ok(if is_data {
            Frame::XLogData {
                data: &self.buf[start..end],
            }
        } else {
            Frame::KeepAlive { wal_end }
        })
    }

    /// Reads until `buf` holds at least `want` bytes.
    async fn fill(&mut self, want: usize) -> Result<()> {
        while self.buf.len() < want {
            // Grown as the bytes arrive, not all at once for what a header claims.
            self.buf
                .reserve((want - self.buf.len()).clamp(READ_CHUNK, 8 * READ_CHUNK * 8));
            read_more(&mut self.read, &mut self.buf, &self.shown).await?;
            self.fresh = true;
        }
        Ok(())
    }

    /// Whether the socket was read since the last call: the server is alive. (Asked per frame,
    /// answered per read: one clock reading per read instead of one per message.)
    pub fn took_read(&mut self) -> bool {
        std::mem::take(&mut self.fresh)
    }
}

/// Writes the standby status every [`STATUS_INTERVAL`] and when a keepalive asks, until the
/// connection fails (the reader then sees it fail too) or the stream is dropped.
async fn send_status(
    mut write: WriteHalf<Socket>,
    reply: Arc<Notify>,
    mut durable: Durable,
    start: u64,
) {
    let mut flushed = start;
    let mut tick = tokio::time::interval(STATUS_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut out = BytesMut::with_capacity(40);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = reply.notified() => {}
        }
        if let Some(position) = durable.newer() {
            if let Ok(lsn) = position.lsn() {
                flushed = flushed.max(lsn.0);
            }
        }
        let written = flushed;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as i64)
            .unwrap_or(0)
            - PG_EPOCH_UNIX_MICROS;
        out.clear();
        out.put_u8(b'd');
        out.put_u32(4 + 1 + 8 * 4 + 1);
        out.put_u8(b'r');
        out.put_u64(written);
        out.put_u64(flushed);
        out.put_u64(flushed);
        out.put_i64(now);
        out.put_u8(0);
        if write.write_all(&out).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    //! The stream's framing over a real loopback socket, fed bytes as a server would send them
    //! (split anywhere), and the status it writes back.

    use super::*;
    use crate::source::Position;
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::watch;

    fn copy_data(body: &[u8]) -> Vec<u8> {
        let mut m = vec![b'd'];
        m.extend(((body.len() + 4) as u32).to_be_bytes());
        m.extend(body);
        m
    }

    fn xlog(data: &[u8]) -> Vec<u8> {
        let mut body = vec![b'w'];
        body.extend(1u64.to_be_bytes());
        body.extend(2u64.to_be_bytes());
        body.extend(0i64.to_be_bytes());
        body.extend(data);
        copy_data(&body)
    }

    fn error_response(code: &str, message: &str) -> Vec<u8> {
        let body = format!("C{code}\0M{message}\0\0");
        let mut m = vec![b'E'];
        m.extend(((body.len() + 4) as u32).to_be_bytes());
        m.extend(body.as_bytes());
        m
    }

    fn keepalive(wal_end: u64, reply: bool) -> Vec<u8> {
        let mut body = vec![b'k'];
        body.extend(wal_end.to_be_bytes());
        body.extend(0i64.to_be_bytes());
        body.push(u8::from(reply));
        copy_data(&body)
    }

    /// A stream whose server side is returned, with the sender of the durable position.
    async fn pair() -> (
        ReplicationStream,
        TcpStream,
        watch::Sender<Option<Position>>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let (tx, rx) = watch::channel(None);
        let stream = ReplicationStream::streaming(
            Box::new(client),
            BytesMut::new(),
            0x100,
            Durable::new(rx, None),
            "test".into(),
        );
        (stream, server, tx)
    }

    #[tokio::test]
    async fn frames_split_anywhere_arrive_whole_and_in_order() {
        let (mut stream, mut server, _durable) = pair().await;
        let mut bytes = xlog(b"first");
        bytes.extend(keepalive(0x500, false));
        bytes.extend(xlog(&vec![7u8; 300_000]));
        bytes.extend(xlog(b"last"));
        let writer = tokio::spawn(async move {
            for chunk in bytes.chunks(7_777) {
                server.write_all(chunk).await.unwrap();
                tokio::task::yield_now().await;
            }
            server
        });
        let Frame::XLogData { data } = stream.next().await.unwrap() else {
            panic!()
        };
        assert_eq!(data, b"first");
        let Frame::KeepAlive { wal_end } = stream.next().await.unwrap() else {
            panic!()
        };
        assert_eq!(wal_end, 0x500);
        let Frame::XLogData { data } = stream.next().await.unwrap() else {
            panic!()
        };
        assert_eq!(data.len(), 300_000);
        let Frame::XLogData { data } = stream.next().await.unwrap() else {
            panic!()
        };
        assert_eq!(data, b"last");
        drop(writer.await.unwrap());
        let e = stream.next().await.err().expect("the connection closed");
        assert!(e.is_transient(), "{e}");
    }

    #[tokio::test]
    async fn bad_lengths_and_server_errors_are_errors_not_panics() {
        for (bytes, transient, text) in [
            (vec![b'd', 0, 0, 0, 2], false, "message length 2"),
            (vec![b'd', 0x7f, 0xff, 0xff, 0xff], false, "exceeds 512 MiB"),
            (copy_data(b"w-too-short"), false, "CopyData"),
            (
                error_response("55006", "slot active"),
                true,
                "slot active (SQLSTATE 55006)",
            ),
            (
                error_response("42704", "no publication"),
                false,
                "no publication (SQLSTATE 42704)",
            ),
        ] {
            let (mut stream, mut server, _durable) = pair().await;
            server.write_all(&bytes).await.unwrap();
            let e = stream.next().await.err().expect("an error");
            assert_eq!(e.is_transient(), transient, "{e}");
            assert!(e.message().contains(text), "{e}");
        }
    }

    #[tokio::test]
    async fn the_status_confirms_only_the_durable_position_and_answers_a_reply_request() {
        let (mut stream, mut server, durable) = pair().await;
        // Data far ahead of what is durable, then a keepalive asking for a reply.
        server.write_all(&xlog(b"row")).await.unwrap();
        server.write_all(&keepalive(0x9000, true)).await.unwrap();
        assert!(matches!(
            stream.next().await.unwrap(),
            Frame::XLogData { .. }
        ));
        assert!(matches!(
            stream.next().await.unwrap(),
            Frame::KeepAlive { .. }
        ));
        let mut status = [0u8; 39];
        let lsns = |s: &[u8; 39]| (u64_at(s, 6), u64_at(s, 14), u64_at(s, 22));
        server.read_exact(&mut status).await.unwrap();
        assert_eq!((status[0], status[5]), (b'd', b'r'));
        assert_eq!(
            lsns(&status),
            (0x100, 0x100, 0x100),
            "only the start is durable"
        );
        durable.send_replace(Some(Position::Lsn(super::super::Lsn(0x200))));
        loop {
            server.read_exact(&mut status).await.unwrap();
            if lsns(&status) != (0x100, 0x100, 0x100) {
                break;
            }
        }
        assert_eq!(lsns(&status), (0x200, 0x200, 0x200));
    }
}
