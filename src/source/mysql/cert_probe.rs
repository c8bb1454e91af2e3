//! Telling a refused client certificate from a network failure when the driver lost the verdict.
//!
//! Under TLS 1.3 the client's side of the handshake ends before the server has judged the client's
//! certificate. mysql_async writes its login packet at once; a server that refuses the certificate
//! sends an alert and closes the socket, and when the server's reset arrives before our write, the
//! write fails with "connection reset" and the alert waiting in our receive queue is never read. On
//! a loaded 2-core machine that happened to about one MariaDB connect in four, so a certificate
//! problem (which waiting never fixes) looked like a network failure (which outboxd retries).
//!
//! [`client_cert_refused`] repeats the connection only as far as the end of the TLS handshake and
//! then *reads* instead of writing. A refused certificate arrives as the alert; an accepted one
//! leaves the server waiting for a login that the probe never sends, so it stops after
//! [`ANSWER_WAIT`]. Only the server's greeting and our SSL request cross in plain text; no user
//! name or password is sent.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::Error;
use crate::source::tls::{alert_error, TlsSettings};

/// Time for each step: TCP connect, the greeting, the TLS handshake.
const STEP_WAIT: Duration = Duration::from_secs(5);
/// How long the server may take to send its verdict after the handshake. A server that accepted
/// our certificate sends nothing (it waits for our login), so this is what an acceptance costs.
const ANSWER_WAIT: Duration = Duration::from_secs(2);
/// A greeting is about a hundred bytes; anything far larger is not a MySQL server.
const MAX_GREETING: usize = 16 * 1024;

/// Capability flags of the SSL request: CLIENT_LONG_PASSWORD (MariaDB reads it as "a MySQL
/// client"), CLIENT_PROTOCOL_41, CLIENT_SSL, CLIENT_SECURE_CONNECTION, CLIENT_PLUGIN_AUTH.
const CAPABILITIES: u32 = 0x0000_0001 | 0x0000_0200 | 0x0000_0800 | 0x0000_8000 | 0x0008_0000;
/// utf8mb4_general_ci.
const CHARSET: u8 = 45;

/// The SSLRequest packet: a 4-byte header (length 32, sequence 1), then capabilities, maximum
/// packet size, character set and 23 zero bytes.
fn ssl_request() -> [u8; 36] {
    let mut packet = [0u8; 36];
    packet[0] = 32;
    packet[3] = 1;
    packet[4..8].copy_from_slice(&CAPABILITIES.to_le_bytes());
    packet[8..12].copy_from_slice(&(16u32 << 20).to_le_bytes());
    packet[12] = CHARSET;
    packet
}

/// The definite "the server refused our client certificate" error if the server at `host:port`
/// refuses the certificate in `settings`; None if it accepts it or the probe cannot tell (the
/// caller's own error then stands).
pub(super) async fn client_cert_refused(
    host: &str,
    port: u16,
    settings: &TlsSettings,
    shown: &str,
) -> Option<Error> {
    let connector = settings.load().ok()??.connector().ok()?;
    let connector = tokio_native_tls::TlsConnector::from(connector);
    let mut tcp = tokio::time::timeout(STEP_WAIT, TcpStream::connect((host, port)))
        .await
        .ok()?
        .ok()?;
    tokio::time::timeout(STEP_WAIT, read_greeting(&mut tcp))
        .await
        .ok()?
        .ok()?;
    tcp.write_all(&ssl_request()).await.ok()?;
    let mut tls = match tokio::time::timeout(STEP_WAIT, connector.connect(host, tcp)).await {
        Ok(Ok(tls)) => tls,
        // TLS 1.2 judges the client's certificate inside the handshake.
        Ok(Err(e)) => return alert_error(shown, &e.to_string()),
        Err(_) => return None,
    };
    let mut byte = [0u8; 1];
    match tokio::time::timeout(ANSWER_WAIT, tls.read(&mut byte)).await {
        Ok(Err(e)) => alert_error(shown, &e.to_string()),
        // Silence (it waits for our login), an end without an alert, or data: not a refusal.
        _ => None,
    }
}

/// Reads the server's first packet and checks that it is a protocol-10 greeting.
async fn read_greeting(tcp: &mut TcpStream) -> std::io::Result<()> {
    let mut header = [0u8; 4];
    tcp.read_exact(&mut header).await?;
    let length =
        usize::from(header[0]) | usize::from(header[1]) << 8 | usize::from(header[2]) << 16;
    if length == 0 || length > MAX_GREETING {
        return Err(std::io::ErrorKind::InvalidData.into());
    }
    let mut payload = vec![0u8; length];
    tcp.read_exact(&mut payload).await?;
    // 0xff is an error packet (too many connections, a blocked host): not ours to explain.
    if payload[0] != 10 {
        return Err(std::io::ErrorKind::InvalidData.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::ssl_request;

    #[test]
    fn the_ssl_request_is_the_protocol_41_packet() {
        let p = ssl_request();
        assert_eq!(&p[..4], &[32, 0, 0, 1], "length 32, sequence 1");
        let caps = u32::from_le_bytes(p[4..8].try_into().unwrap());
        assert_ne!(caps & 0x800, 0, "CLIENT_SSL");
        assert_ne!(caps & 0x200, 0, "CLIENT_PROTOCOL_41");
        assert!(p[13..].iter().all(|b| *b == 0), "the filler is zero");
    }
}
