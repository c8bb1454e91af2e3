//! The socket under both Postgres connections (replication and control): TCP, then TLS when
//! `source.tls` asks for it.
//!
//! Postgres starts TLS inside its own protocol: the client sends an SSLRequest, the server answers
//! one byte (`S`: go ahead, `N`: no TLS here) and the handshake follows on the same socket. Both
//! connections come through [`connect`], so they are encrypted and verified the same way; the
//! control connection hands the result to tokio-postgres as an already-secured stream.
//!
//! Exactly one byte is read before the handshake: anything a man in the middle slips in behind the
//! `S` is TLS input, which fails the handshake instead of being read as the server's words.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::control::ConnInfo;
use crate::error::{Error, Result};
use crate::source::config::TlsMode;
use crate::source::tls::{alert_error, handshake_error, no_tls_error};

/// Time allowed for the TCP connect and, separately, for the TLS negotiation.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The SSLRequest message: length 8, request code 80877103.
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

/// A connected socket, plain or TLS.
pub trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}
pub type Socket = Box<dyn Stream>;

/// How the connection is protected (outboxd's side; a proxy may differ from what the server sees).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protection {
    Plain,
    Tls,
}

fn unreachable(info: &ConnInfo, what: String) -> Error {
    Error::source(format!("cannot connect to {}: {what}", info.shown))
        .remedy("outboxd retries; check that the server is up and reachable")
        .transient()
}

/// How long [`client_cert_refused`] waits for the server's verdict after the handshake. A server
/// that accepted our certificate says nothing (it waits for our startup message), so this is what
/// an acceptance costs.
const VERDICT_WAIT: Duration = Duration::from_secs(2);

/// After a login broke with a reset while we presented a client certificate: the definite "the
/// server refused our client certificate" error if that is what happened, else None.
///
/// Under TLS 1.3 the server judges our certificate after our side of the handshake has ended, and
/// we write the startup message at once. A refusing server sends an alert and closes; when its
/// reset arrives before our write, the write fails and the alert waiting in the receive queue is
/// never read (about one login in two on a loaded 2-core machine). So this connects again, as far
/// as the end of the handshake, and reads instead of writing: the alert, or silence.
pub async fn client_cert_refused(info: &ConnInfo) -> Option<Error> {
    let presents = info.tls.as_ref()?.settings.cert.is_some();
    if !presents {
        return None;
    }
    let mut socket = match connect(info).await {
        Ok((socket, Protection::Tls)) => socket,
        // TLS 1.2 judges the certificate inside the handshake: that error is the verdict.
        Err(e) if !e.is_transient() => return Some(e),
        _ => return None,
    };
    let mut byte = [0u8; 1];
    match tokio::time::timeout(VERDICT_WAIT, socket.read(&mut byte)).await {
        Ok(Err(e)) => alert_error(&info.shown, &e.to_string()),
        _ => None,
    }
}

/// Opens a socket to `info`'s server, negotiating TLS as `info.tls` says.
pub async fn connect(info: &ConnInfo) -> Result<(Socket, Protection)> {
    let mut tcp = match tokio::time::timeout(
        CONNECT_TIMEOUT,
        TcpStream::connect((info.host.as_str(), info.port)),
    )
    .await
    {
        Ok(Ok(tcp)) => tcp,
        Ok(Err(e)) => return Err(unreachable(info, e.to_string())),
        Err(_) => return Err(unreachable(info, "no answer within 10 s".into())),
    };
    let _ = tcp.set_nodelay(true);
    // A dead peer is noticed by the kernel too (tokio-postgres did this itself before it was handed
    // an open socket).
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(5));
    let _ = socket2::SockRef::from(&tcp).set_tcp_keepalive(&keepalive);
    let Some(tls) = &info.tls else {
        return Ok((Box::new(tcp), Protection::Plain));
    };
    let negotiate = async {
        tcp.write_all(&SSL_REQUEST).await?;
        let mut answer = [0u8; 1];
        tcp.read_exact(&mut answer).await?;
        Ok::<u8, std::io::Error>(answer[0])
    };
    let answer = match tokio::time::timeout(CONNECT_TIMEOUT, negotiate).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => return Err(unreachable(info, format!("asking for TLS: {e}"))),
        Err(_) => {
            return Err(unreachable(
                info,
                "no answer to the TLS request within 10 s".into(),
            ))
        }
    };
    match answer {
        b'S' => {}
        b'N' if tls.settings.mode == TlsMode::Prefer => {
            tracing::warn!(
                server = %info.shown,
                "the server does not offer TLS; connecting in plain text (source.tls mode prefer)"
            );
            return Ok((Box::new(tcp), Protection::Plain));
        }
        b'N' => return Err(no_tls_error(&info.shown, &tls.settings)),
        // The server could not start a session for us (out of processes, say). What follows is an
        // unencrypted message nobody vouches for: not read, not shown.
        b'E' => {
            return Err(Error::source(format!(
                "{}: the server refused the TLS request before any session started",
                info.shown
            ))
            .remedy("outboxd retries; the server may be short of connections or processes")
            .transient())
        }
        other => {
            return Err(Error::source(format!(
                "{}: unexpected answer {other:#04x} to the TLS request",
                info.shown
            ))
            .remedy("is this a Postgres server? check source.url's host and port"))
        }
    }
    let connector = tokio_native_tls::TlsConnector::from(tls.connector()?);
    match tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(&info.host, tcp)).await {
        Ok(Ok(stream)) => Ok((Box::new(stream), Protection::Tls)),
        Ok(Err(e)) => Err(handshake_error(
            &info.shown,
            &tls.settings,
            &info.host,
            &e.to_string(),
        )),
        Err(_) => Err(unreachable(
            info,
            "the TLS handshake did not finish within 10 s".into(),
        )),
    }
}
