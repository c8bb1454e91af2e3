//! TLS to the database: one setting for every connection outboxd opens to it.
//!
//! `source.tls = { mode, ca, cert, key }` and the URL's own TLS parameters (Postgres `sslmode`,
//! `sslrootcert`, `sslcert`, `sslkey`; MySQL `ssl-mode`, `ssl-ca`, `ssl-cert`, `ssl-key`) resolve here
//! into one [`TlsSettings`]; a URL parameter that disagrees with `source.tls`, or a TLS parameter
//! outboxd cannot honour, is refused by name, never ignored.
//!
//! Why native-tls (OpenSSL on Linux): mysql_async speaks TLS through native-tls or rustls only, and
//! librdkafka already links OpenSSL; native-tls over that same OpenSSL keeps one crypto library in
//! the binary and adds no C build. The `openssl` crate (already built for native-tls) turns a PEM
//! certificate and key, in any key format, into the PKCS#12 identity both drivers take.
//!
//! Modes, as libpq defines them:
//! - `disable`: plain text.
//! - `prefer`: TLS when the server offers it, plain text otherwise; the certificate is not checked.
//! - `require`: TLS or nothing; the certificate is not checked unless `ca` is given (then the chain
//!   is, as libpq does with `sslrootcert`).
//! - `verify-ca`: TLS, the chain checked against `ca` (required); any host name.
//! - `verify-full`: `verify-ca` plus the host name in `source.url` must match the certificate.
//!
//! A certificate problem is a definite error (no retry loop): [`explain`] names which one it is
//! (unknown CA, wrong host name, expired, server without TLS, client certificate refused) and the fix.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::source::config::{SourceConfig, SourceKind, TlsMode};

/// The TLS a source's connections use, resolved from `source.tls` and the URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: TlsMode,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// The URL parameters read here, per database (removed before the URL reaches a driver).
pub fn url_tls_keys(kind: SourceKind) -> &'static [&'static str] {
    match kind {
        SourceKind::Postgres => &["sslmode", "sslrootcert", "sslcert", "sslkey"],
        SourceKind::Mysql => &["ssl-mode", "ssl-ca", "ssl-cert", "ssl-key"],
    }
}

/// mysql_async's own TLS switches: they would bypass `source.tls`, so they are refused.
const MYSQL_DRIVER_TLS_KEYS: &[&str] = &[
    "require_ssl",
    "verify_ca",
    "verify_identity",
    "built_in_roots",
];

impl TlsMode {
    pub fn as_str(self) -> &'static str {
        match self {
            TlsMode::Disable => "disable",
            TlsMode::Prefer => "prefer",
            TlsMode::Require => "require",
            TlsMode::VerifyCa => "verify-ca",
            TlsMode::VerifyFull => "verify-full",
        }
    }
}

fn url_mode(kind: SourceKind, value: &str) -> Option<TlsMode> {
    match kind {
        SourceKind::Postgres => match value {
            "disable" => Some(TlsMode::Disable),
            "prefer" => Some(TlsMode::Prefer),
            "require" => Some(TlsMode::Require),
            "verify-ca" => Some(TlsMode::VerifyCa),
            "verify-full" => Some(TlsMode::VerifyFull),
            _ => None,
        },
        SourceKind::Mysql => match value.to_ascii_uppercase().as_str() {
            "DISABLED" => Some(TlsMode::Disable),
            "PREFERRED" => Some(TlsMode::Prefer),
            "REQUIRED" => Some(TlsMode::Require),
            "VERIFY_CA" => Some(TlsMode::VerifyCa),
            "VERIFY_IDENTITY" => Some(TlsMode::VerifyFull),
            _ => None,
        },
    }
}

impl TlsSettings {
    /// `source.tls` merged with the URL's TLS parameters (the first host's; every host of a list
    /// shares the query).
    pub fn of(config: &SourceConfig) -> Result<TlsSettings> {
        let kind = config.kind();
        let table = config.tls.as_ref();
        let mut settings = TlsSettings {
            mode: table.map_or(TlsMode::Disable, |t| t.mode),
            ca: table.and_then(|t| t.ca.clone()),
            cert: table.and_then(|t| t.cert.clone()),
            key: table.and_then(|t| t.key.clone()),
        };
        let first = config.urls().into_iter().next().unwrap_or_default();
        let Ok(url) = url::Url::parse(&first) else {
            settings.check()?;
            return Ok(settings);
        };
        let keys = url_tls_keys(kind);
        let [mode_key, ca_key, cert_key, key_key] = [keys[0], keys[1], keys[2], keys[3]];
        let mut seen: Vec<String> = Vec::new();
        for (key, value) in url.query_pairs() {
            let key = key.as_ref();
            if keys.contains(&key) {
                if seen.iter().any(|k| k == key) {
                    return Err(
                        Error::config(format!("source.url sets {key} twice")).remedy("keep one")
                    );
                }
                seen.push(key.to_string());
            }
            if kind == SourceKind::Mysql && MYSQL_DRIVER_TLS_KEYS.contains(&key) {
                return Err(Error::config(format!(
                    "source.url parameter {key:?} is not used by outboxd"
                ))
                .remedy("set TLS with source.tls = { mode = \"verify-full\", ca = \"/path/ca.pem\" } (or the URL's ssl-mode / ssl-ca)"));
            }
            if !keys.contains(&key) {
                continue;
            }
            let conflict = |what: &str, table_value: String| {
                Error::config(format!(
                    "source.url sets {key}={value} but source.tls sets {what} = {table_value}"
                ))
                .remedy("set TLS in one place: source.tls or the URL")
            };
            if key == mode_key {
                let mode = url_mode(kind, &value).ok_or_else(|| {
                    Error::config(format!("source.url {key}={value} is not a TLS mode outboxd knows"))
                        .remedy(match kind {
                            SourceKind::Postgres => "use sslmode=disable, prefer, require, verify-ca or verify-full",
                            SourceKind::Mysql => "use ssl-mode=DISABLED, PREFERRED, REQUIRED, VERIFY_CA or VERIFY_IDENTITY",
                        })
                })?;
                match table {
                    Some(t) if t.mode != mode => {
                        return Err(conflict("mode", t.mode.as_str().to_string()))
                    }
                    _ => settings.mode = mode,
                }
            } else {
                let slot = if key == ca_key {
                    &mut settings.ca
                } else if key == cert_key {
                    &mut settings.cert
                } else {
                    debug_assert_eq!(key, key_key);
                    &mut settings.key
                };
                let path = PathBuf::from(value.as_ref());
                match slot {
                    Some(existing) if *existing != path => {
                        return Err(conflict("a path", existing.display().to_string()))
                    }
                    _ => *slot = Some(path),
                }
            }
        }
        if kind == SourceKind::Mysql
            && settings.mode != TlsMode::Disable
            && url.query_pairs().any(|(k, _)| k == "socket")
        {
            // mysql_async does not secure a Unix socket: the TLS asked for would not happen.
            return Err(Error::config(
                "source.url names a Unix socket, which outboxd cannot reach over TLS",
            )
            .remedy("connect over TCP (host:port) with source.tls, or use the socket with source.tls mode disable"));
        }
        settings.check()?;
        Ok(settings)
    }

    fn check(&self) -> Result<()> {
        if self.cert.is_some() != self.key.is_some() {
            return Err(
                Error::config("source.tls: a client certificate needs both cert and key")
                    .remedy("set both source.tls.cert and source.tls.key (PEM files), or neither"),
            );
        }
        if self.mode == TlsMode::VerifyCa && self.ca.is_none() {
            // Any publicly trusted certificate for any name would pass; libpq refuses it too.
            return Err(
                Error::config("source.tls mode verify-ca needs source.tls.ca").remedy(
                    "set source.tls.ca to the CA that signed the server's certificate, or use verify-full (the system's roots and the host name)",
                ),
            );
        }
        if self.mode == TlsMode::Prefer && self.ca.is_some() {
            return Err(
                Error::config("source.tls gives a CA but mode prefer never checks it").remedy(
                    "use mode = \"verify-full\" (or \"verify-ca\") to have the certificate checked",
                ),
            );
        }
        if self.mode == TlsMode::Disable && (self.ca.is_some() || self.cert.is_some()) {
            return Err(Error::config(
                "source.tls gives certificates but its mode is disable (plain text)",
            )
            .remedy("set source.tls.mode = \"verify-full\" (or remove the certificates)"));
        }
        Ok(())
    }

    /// Whether the server's certificate chain is checked.
    pub fn verifies_chain(&self) -> bool {
        match self.mode {
            TlsMode::VerifyCa | TlsMode::VerifyFull => true,
            TlsMode::Require => self.ca.is_some(),
            TlsMode::Disable | TlsMode::Prefer => false,
        }
    }

    /// Reads the certificate files (None under `disable`).
    pub fn load(&self) -> Result<Option<ClientTls>> {
        if self.mode == TlsMode::Disable {
            return Ok(None);
        }
        let ca = match &self.ca {
            Some(path) => {
                let pem = read("source.tls.ca", path)?;
                openssl::x509::X509::stack_from_pem(&pem)
                    .ok()
                    .filter(|certs| !certs.is_empty())
                    .ok_or_else(|| {
                        Error::config(format!(
                            "source.tls.ca {} holds no PEM certificate",
                            path.display()
                        ))
                        .remedy("give the CA certificate(s) that signed the server's certificate, PEM encoded")
                    })?;
                Some(pem)
            }
            None => None,
        };
        let identity = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => Some(pkcs12(cert, key)?),
            _ => None,
        };
        Ok(Some(ClientTls {
            settings: self.clone(),
            ca,
            identity,
        }))
    }

    /// One line for `check`: what is verified.
    pub fn describe(&self, host: &str) -> String {
        let against = match &self.ca {
            Some(ca) => format!("against {}", ca.display()),
            None => "against the system's trusted roots".to_string(),
        };
        let client = if self.cert.is_some() {
            ", client certificate sent"
        } else {
            ""
        };
        match self.mode {
            TlsMode::Disable => "plain text (source.tls mode disable)".to_string(),
            TlsMode::Prefer => format!("prefer: certificate not checked{client}"),
            TlsMode::Require if self.ca.is_some() => {
                format!("require: chain verified {against}, host name not checked{client}")
            }
            TlsMode::Require => format!("require: certificate not checked{client}"),
            TlsMode::VerifyCa => {
                format!("verify-ca: chain verified {against}, host name not checked{client}")
            }
            TlsMode::VerifyFull => {
                format!(
                    "verify-full: chain verified {against}, server name {host} verified{client}"
                )
            }
        }
    }
}

fn read(what: &str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| {
        Error::config(format!("cannot read {what} {}: {e}", path.display()))
            .remedy("check the path and that outboxd may read it")
    })
}

/// A PEM certificate (plus any chain after it) and a PEM key (PKCS#1, PKCS#8 or SEC1) as the
/// PKCS#12 archive both drivers accept.
fn pkcs12(cert_path: &Path, key_path: &Path) -> Result<Vec<u8>> {
    let cert_pem = read("source.tls.cert", cert_path)?;
    let key_pem = read("source.tls.key", key_path)?;
    let mut certs = openssl::x509::X509::stack_from_pem(&cert_pem).unwrap_or_default();
    if certs.is_empty() {
        return Err(Error::config(format!(
            "source.tls.cert {} holds no PEM certificate",
            cert_path.display()
        ))
        .remedy("give the client certificate, PEM encoded"));
    }
    let key = openssl::pkey::PKey::private_key_from_pem(&key_pem).map_err(|_| {
        Error::config(format!(
            "source.tls.key {} is not an unencrypted PEM private key",
            key_path.display()
        ))
        .remedy(
            "give the client key as PEM without a passphrase (openssl pkey -in KEY -out KEY.pem)",
        )
    })?;
    let leaf = certs.remove(0);
    if !leaf.public_key().is_ok_and(|public| public.public_eq(&key)) {
        return Err(Error::config(format!(
            "source.tls.key {} does not belong to the certificate in {}",
            key_path.display(),
            cert_path.display()
        ))
        .remedy("pair the client certificate with its own key"));
    }
    let mut chain = openssl::stack::Stack::new().map_err(internal)?;
    for c in certs {
        chain.push(c).map_err(internal)?;
    }
    let mut builder = openssl::pkcs12::Pkcs12::builder();
    builder.name("outboxd").pkey(&key).cert(&leaf).ca(chain);
    let archive = builder.build2("").map_err(internal)?;
    archive.to_der().map_err(internal)
}

fn internal(e: openssl::error::ErrorStack) -> Error {
    Error::config(format!("cannot prepare the client certificate: {e}"))
}

/// The loaded TLS material, ready to configure a driver.
#[derive(Clone)]
pub struct ClientTls {
    pub settings: TlsSettings,
    ca: Option<Vec<u8>>,
    /// PKCS#12 DER, no password.
    identity: Option<Vec<u8>>,
}

impl ClientTls {
    /// A connector for a Postgres connection (native-tls).
    pub fn connector(&self) -> Result<native_tls::TlsConnector> {
        let mut builder = native_tls::TlsConnector::builder();
        builder.min_protocol_version(Some(native_tls::Protocol::Tlsv12));
        if let Some(pem) = &self.ca {
            for cert in openssl::x509::X509::stack_from_pem(pem).map_err(internal)? {
                let der = cert.to_der().map_err(internal)?;
                let cert = native_tls::Certificate::from_der(&der).map_err(tls_setup)?;
                builder.add_root_certificate(cert);
            }
            // Only the named CA, as libpq does with sslrootcert.
            builder.disable_built_in_roots(true);
        }
        if let Some(archive) = &self.identity {
            builder.identity(native_tls::Identity::from_pkcs12(archive, "").map_err(tls_setup)?);
        }
        match self.settings.mode {
            TlsMode::VerifyFull => {}
            TlsMode::VerifyCa => {
                builder.danger_accept_invalid_hostnames(true);
            }
            TlsMode::Require if self.ca.is_some() => {
                builder.danger_accept_invalid_hostnames(true);
            }
            TlsMode::Require | TlsMode::Prefer | TlsMode::Disable => {
                builder.danger_accept_invalid_certs(true);
            }
        }
        builder.build().map_err(tls_setup)
    }

    /// The same settings for mysql_async.
    pub fn mysql(&self) -> mysql_async::SslOpts {
        use mysql_async::{ClientIdentity, SslOpts};
        let mut opts = SslOpts::default();
        if let Some(pem) = &self.ca {
            opts = opts
                .with_root_certs(vec![pem.clone().into()])
                .with_disable_built_in_roots(true);
        }
        if let Some(archive) = &self.identity {
            opts = opts.with_client_identity(Some(ClientIdentity::new(archive.clone().into())));
        }
        match self.settings.mode {
            TlsMode::VerifyFull => opts,
            TlsMode::VerifyCa => opts.with_danger_skip_domain_validation(true),
            TlsMode::Require if self.ca.is_some() => opts.with_danger_skip_domain_validation(true),
            TlsMode::Require | TlsMode::Prefer | TlsMode::Disable => {
                opts.with_danger_accept_invalid_certs(true)
            }
        }
    }
}

fn tls_setup(e: native_tls::Error) -> Error {
    Error::config(format!("cannot set up TLS: {e}"))
        .remedy("check source.tls.ca, cert and key (PEM files)")
}

/// What went wrong in a TLS handshake, read from the library's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    UnknownCa,
    WrongHost,
    Expired,
    NotYetValid,
    /// The server sent an alert about our side: its CA does not know our client certificate, or
    /// it wants one and got none. Under TLS 1.3 this arrives after our side of the handshake, on
    /// the first read.
    ClientCertRefused,
    /// Another failure inside TLS itself (protocol versions, ciphers, not TLS at all).
    Handshake,
}

/// Classifies an OpenSSL message (native-tls puts the verify result in its text). None: not a TLS
/// problem (a reset or timeout is the network's, and transient).
pub fn classify(text: &str) -> Option<Problem> {
    let t = text.to_ascii_lowercase();
    let any = |needles: &[&str]| needles.iter().any(|n| t.contains(n));
    // An alert is the server's verdict on us; the verify results below are ours on the server.
    if any(&[
        "alert certificate required",
        "alert unknown ca",
        "alert bad certificate",
        "alert certificate unknown",
        "alert certificate revoked",
        "alert certificate expired",
        "alert unsupported certificate",
        "alert access denied",
    ]) {
        Some(Problem::ClientCertRefused)
    } else if any(&[
        "hostname mismatch",
        "ip address mismatch",
        "host name mismatch",
    ]) {
        Some(Problem::WrongHost)
    } else if any(&["certificate has expired"]) {
        Some(Problem::Expired)
    } else if any(&["certificate is not yet valid"]) {
        Some(Problem::NotYetValid)
    } else if any(&[
        "unable to get local issuer certificate",
        "self-signed certificate",
        "self signed certificate",
        "unable to verify the first certificate",
        "unable to get issuer certificate",
        "certificate signature failure",
    ]) {
        Some(Problem::UnknownCa)
    } else if any(&["unexpected eof", "connection reset", "broken pipe"]) {
        // The peer went away mid-handshake (a restart, a proxy without a backend): the network's.
        None
    } else if any(&[
        "ssl routines",
        "certificate verify failed",
        "wrong version number",
    ]) {
        Some(Problem::Handshake)
    } else {
        None
    }
}

/// The error for a failed TLS handshake with `server` (shown redacted), naming the problem and its
/// fix; `detail` is the library's message. A certificate or protocol problem is definite (waiting
/// does not fix it); a network failure during the handshake is transient.
pub fn handshake_error(server: &str, settings: &TlsSettings, host: &str, detail: &str) -> Error {
    let ca = match &settings.ca {
        Some(path) => format!("source.tls.ca ({})", path.display()),
        None => "the system's trusted roots (no source.tls.ca given)".to_string(),
    };
    let Some(problem) = classify(detail) else {
        return Error::source(format!(
            "{server}: the connection failed during the TLS handshake: {detail}"
        ))
        .remedy("outboxd retries; check that the server is up and reachable")
        .transient();
    };
    let (what, fix) = match problem {
        Problem::UnknownCa => (
            format!("the server's certificate is not signed by a CA in {ca}"),
            "set source.tls.ca to the CA certificate that signed the server's certificate".to_string(),
        ),
        Problem::WrongHost => (
            format!("the server's certificate is not valid for the host name {host:?}"),
            "put a host name the certificate names in source.url (see its subjectAltName); mode = \"verify-ca\" with source.tls.ca skips the name check".to_string(),
        ),
        Problem::Expired => (
            "the server's certificate has expired".to_string(),
            "renew the server's certificate (outboxd never accepts an expired one under verify-ca/verify-full)".to_string(),
        ),
        Problem::NotYetValid => (
            "the server's certificate is not valid yet".to_string(),
            "check the clocks of this machine and the server, or the certificate's start date".to_string(),
        ),
        Problem::ClientCertRefused => return client_cert_refused(server, detail),
        Problem::Handshake => (
            "the TLS handshake failed".to_string(),
            "check source.tls and the server's TLS settings (protocol versions, ciphers; is this port TLS at all?); the detail says what the library saw".to_string(),
        ),
    };
    Error::source(format!("{server}: TLS: {what}: {detail}")).remedy(fix)
}

fn client_cert_refused(server: &str, detail: &str) -> Error {
    Error::source(format!(
        "{server}: TLS: the server refused our client certificate (or wants one): {detail}"
    ))
    .remedy("set source.tls.cert and source.tls.key to a certificate signed by a CA the server trusts (Postgres ssl_ca_file, MySQL ssl_ca)")
}

/// The definite error for a connection that broke with a TLS alert after the handshake (TLS 1.3
/// reports a refused client certificate on the first read); None for an ordinary network failure.
pub fn alert_error(server: &str, detail: &str) -> Option<Error> {
    (classify(detail) == Some(Problem::ClientCertRefused))
        .then(|| client_cert_refused(server, detail))
}

/// True if `e` (or an error under it) is a connection that broke after it was set up: a reset,
/// an abort, a broken pipe or an early end. Right after a TLS 1.3 handshake with a client
/// certificate, that is also how a refusal looks when the server's reset overtakes its alert; the
/// sources then ask again without writing (`mysql/cert_probe.rs`, `postgres/socket.rs`).
pub fn connection_lost(e: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof
            ) {
                return true;
            }
        }
        next = e.source();
    }
    false
}

/// The server does not offer TLS although `source.tls` requires it.
pub fn no_tls_error(server: &str, settings: &TlsSettings) -> Error {
    Error::source(format!(
        "{server} does not offer TLS, and source.tls mode {} requires it",
        settings.mode.as_str()
    ))
    .remedy("enable TLS on the server (Postgres ssl = on; MySQL/MariaDB ssl_cert/ssl_key), or set source.tls.mode = \"prefer\" to allow plain text")
}

/// The remedy for a server that refuses plain text while `source.tls` is `disable`.
pub const NEEDS_TLS_REMEDY: &str = "the server accepts only TLS connections: set source.tls = { mode = \"verify-full\", ca = \"/path/ca.pem\" } (docs/sources/tls.md)";

#[cfg(test)]
mod tests {
    use super::*;

    fn source(url: &str, tls: &str) -> SourceConfig {
        let kind = if url.starts_with("postgres") {
            "postgres"
        } else {
            "mysql"
        };
        let text =
            format!("kind = \"{kind}\"\nurl = \"{url}\"\ntables = [\"app.outbox\"]\n{tls}\n");
        toml::from_str(&text).unwrap()
    }

    #[test]
    fn url_parameters_map_onto_source_tls() {
        let c = source(
            "postgres://cdc@db/app?sslmode=verify-full&sslrootcert=/ca.pem",
            "",
        );
        let s = TlsSettings::of(&c).unwrap();
        assert_eq!(s.mode, TlsMode::VerifyFull);
        assert_eq!(s.ca.as_deref(), Some(Path::new("/ca.pem")));
        let c = source("mysql://cdc@db/app?ssl-mode=VERIFY_CA&ssl-ca=/ca.pem", "");
        let s = TlsSettings::of(&c).unwrap();
        assert_eq!(s.mode, TlsMode::VerifyCa);
        // The same value in both places is fine; different values are refused.
        let c = source(
            "postgres://cdc@db/app?sslmode=require",
            "tls = { mode = \"require\" }",
        );
        assert_eq!(TlsSettings::of(&c).unwrap().mode, TlsMode::Require);
        let c = source(
            "postgres://cdc@db/app?sslmode=disable",
            "tls = { mode = \"verify-full\" }",
        );
        let e = TlsSettings::of(&c).unwrap_err();
        assert!(e.message().contains("sslmode=disable"), "{e}");
    }

    #[test]
    fn tls_parameters_outboxd_does_not_honour_are_refused_by_name() {
        for key in MYSQL_DRIVER_TLS_KEYS {
            let c = source(&format!("mysql://cdc@db/app?{key}=true"), "");
            let e = TlsSettings::of(&c).unwrap_err();
            assert!(e.message().contains(key), "{e}");
        }
        let c = source("postgres://cdc@db/app?sslmode=allow", "");
        assert!(TlsSettings::of(&c).unwrap_err().message().contains("allow"));
        let c = source(
            "postgres://cdc@db/app?sslmode=verify-full&sslmode=disable",
            "",
        );
        assert!(TlsSettings::of(&c).unwrap_err().message().contains("twice"));
        let c = source("postgres://cdc@db/app?sslmode=verify-ca", "");
        assert!(TlsSettings::of(&c)
            .unwrap_err()
            .message()
            .contains("needs source.tls.ca"));
        let c = source(
            "mysql://cdc@db/app?ssl-mode=REQUIRED&socket=%2Ftmp%2Fm.sock",
            "",
        );
        assert!(TlsSettings::of(&c)
            .unwrap_err()
            .message()
            .contains("Unix socket"));
        let c = source(
            "postgres://cdc@db/app",
            "tls = { mode = \"verify-full\", cert = \"/c.pem\" }",
        );
        assert!(TlsSettings::of(&c)
            .unwrap_err()
            .message()
            .contains("both cert and key"));
    }

    #[test]
    fn handshake_messages_are_classified() {
        let cases = [
            ("error:0A000086:SSL routines:tls_post_process_server_certificate:certificate verify failed:ssl/statem/statem_clnt.c:1889: (unable to get local issuer certificate)", Problem::UnknownCa),
            ("certificate verify failed (self-signed certificate in certificate chain)", Problem::UnknownCa),
            ("certificate verify failed (Hostname mismatch)", Problem::WrongHost),
            ("certificate verify failed (IP address mismatch)", Problem::WrongHost),
            ("certificate verify failed (certificate has expired)", Problem::Expired),
            ("error:0A00045C:SSL routines::tlsv13 alert certificate required", Problem::ClientCertRefused),
            ("error:0A000418:SSL routines::tlsv1 alert unknown ca", Problem::ClientCertRefused),
        ];
        for (text, want) in cases {
            assert_eq!(classify(text), Some(want), "{text}");
        }
        assert_eq!(classify("connection refused"), None);
        assert_eq!(
            classify("error:0A000126:SSL routines::unexpected eof while reading"),
            None
        );
        // Words in host names are not TLS problems.
        assert_eq!(
            classify("kafka-tls-0:9093: Connection reset by peer during the handshake"),
            None
        );
    }
}
