//! Opening a connection to MySQL/MariaDB (the binlog stream and the query connection alike), and
//! what its errors mean.
//!
//! Every connection comes through [`open`], so all of them carry the same TLS (`source.tls`, see
//! `source/tls.rs`). Under `prefer`, a server that does not offer TLS gets a plain connection; under
//! every other mode it is refused. TLS parameters in the URL were read into the TLS settings and are
//! removed before mysql_async parses the URL.
//!
//! [`map_err`] is the one table of what a driver error means: a reconnect cures it (transient) or a
//! person must act (definite, with the fix).

use std::time::Duration;

use mysql_async::{Conn, DriverError, IoError, Opts, OptsBuilder};

use super::cert_probe;
use crate::error::{Error, Result};
use crate::source::config::{redact_url, SourceConfig, SourceKind, TlsMode};
use crate::source::tls::{
    alert_error, connection_lost, handshake_error, no_tls_error, url_tls_keys, TlsSettings,
    NEEDS_TLS_REMEDY,
};

pub(super) const ER_ACCESS_DENIED: u16 = 1045;
const ER_SPECIFIC_ACCESS_DENIED: u16 = 1227;
const ER_BAD_DB: u16 = 1049;
/// MySQL's `require_secure_transport` refusal; MariaDB's has the same code.
const ER_SECURE_TRANSPORT_REQUIRED: u16 = 3159;

/// Server errors a reconnect cures: too many connections (1040), shutdown in progress (1053, 1077-
/// 1080), network trouble seen by the server (1152, 1158-1161), connection killed (1927), and
/// MariaDB's idle-connection timeout (4031).
const TRANSIENT_SERVER_ERRORS: [u16; 13] = [
    1040, 1053, 1077, 1078, 1079, 1080, 1152, 1158, 1159, 1160, 1161, 1927, 4031,
];

/// The driver options for `config`'s first host, TLS included.
pub(super) fn connect_opts(config: &SourceConfig) -> Result<(Opts, TlsSettings)> {
    let tls = TlsSettings::of(config)?;
    // With several hosts, the pipeline picks one per session; other callers use the first.
    let url = config.urls().into_iter().next().unwrap_or_default();
    let url = without_tls_keys(&url);
    let opts = Opts::from_url(&url).map_err(|e| {
        Error::config(format!("source.url {}: {e}", redact_url(&config.url)))
            .remedy("use mysql://USER[:PASSWORD]@HOST:PORT/DB")
    })?;
    let mut builder = OptsBuilder::from_opts(opts)
        .prefer_socket(false)
        .tcp_keepalive(Some(Duration::from_secs(10)));
    if let Some(password) = config.password()? {
        builder = builder.pass(Some(password));
    }
    if let Some(client) = tls.load()? {
        builder = builder.ssl_opts(Some(client.mysql()));
    }
    Ok((builder.into(), tls))
}

/// `url` without the TLS parameters [`TlsSettings::of`] already read.
fn without_tls_keys(url: &str) -> String {
    let Ok(mut parsed) = url::Url::parse(url) else {
        return url.to_string();
    };
    let keys = url_tls_keys(SourceKind::Mysql);
    if !parsed
        .query_pairs()
        .any(|(k, _)| keys.contains(&k.as_ref()))
    {
        return url.to_string();
    }
    let kept: Vec<(String, String)> = parsed
        .query_pairs()
        .filter(|(k, _)| !keys.contains(&k.as_ref()))
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    if kept.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(kept);
    }
    parsed.to_string()
}

/// A connection to `config`'s first host, as the driver reports its failure.
pub(super) async fn open_raw(config: &SourceConfig) -> std::result::Result<Conn, ConnectFailure> {
    let (opts, tls) = connect_opts(config).map_err(ConnectFailure::Explained)?;
    let result = Conn::new(opts.clone()).await;
    if let Err(e) = &result {
        // Not inside the handshake (that is IoError::Tls): the case cert_probe.rs explains.
        let after_handshake = matches!(e, mysql_async::Error::Io(IoError::Io(_)));
        if tls.cert.is_some() && after_handshake && connection_lost(e) {
            let shown = redact_url(&config.url);
            let probe = cert_probe::client_cert_refused(
                opts.ip_or_hostname(),
                opts.tcp_port(),
                &tls,
                &shown,
            );
            if let Some(refused) = probe.await {
                return Err(ConnectFailure::Explained(refused));
            }
        }
    }
    match result {
        Err(mysql_async::Error::Driver(DriverError::NoClientSslFlagFromServer))
            if tls.mode == TlsMode::Prefer =>
        {
            tracing::warn!(
                server = %redact_url(&config.url),
                "the server does not offer TLS; connecting in plain text (source.tls mode prefer)"
            );
            Conn::new(OptsBuilder::from_opts(opts).ssl_opts(None))
                .await
                .map_err(ConnectFailure::Driver)
        }
        other => other.map_err(ConnectFailure::Driver),
    }
}

pub(super) enum ConnectFailure {
    /// Already an outboxd error with its remedy (a bad setting, a refused client certificate).
    Explained(Error),
    Driver(mysql_async::Error),
}

/// A connection to `config`'s first host.
pub(super) async fn open(config: &SourceConfig) -> Result<Conn> {
    open_raw(config).await.map_err(|f| match f {
        ConnectFailure::Explained(e) => e,
        ConnectFailure::Driver(e) => map_err(e, config),
    })
}

/// What a driver error on a connection to `config`'s server means, and what to do.
pub(super) fn map_err(e: mysql_async::Error, config: &SourceConfig) -> Error {
    explain(&e, config).caused_by(e)
}

fn explain(e: &mysql_async::Error, config: &SourceConfig) -> Error {
    let server = redact_url(&config.url);
    let tls = || {
        TlsSettings::of(config).unwrap_or(TlsSettings {
            mode: TlsMode::Disable,
            ca: None,
            cert: None,
            key: None,
        })
    };
    match e {
        mysql_async::Error::Io(IoError::Tls(e)) => {
            let host = config
                .urls()
                .first()
                .and_then(|u| url::Url::parse(u).ok())
                .and_then(|u| u.host_str().map(str::to_string))
                .unwrap_or_default();
            handshake_error(&server, &tls(), &host, &e.to_string())
        }
        mysql_async::Error::Driver(DriverError::NoClientSslFlagFromServer) => {
            no_tls_error(&server, &tls())
        }
        mysql_async::Error::Server(se) if se.code == ER_SECURE_TRANSPORT_REQUIRED => {
            Error::source(format!("{server} refused the login: {}", se.message)).remedy(NEEDS_TLS_REMEDY)
        }
        mysql_async::Error::Server(se) if se.code == ER_ACCESS_DENIED => {
            let fix = if tls().mode == TlsMode::Disable {
                "check the user and password (source.url, OUTBOXD_SOURCE__PASSWORD or source.password_file); a server that accepts only TLS (require_secure_transport, or an account created with REQUIRE SSL/X509) refuses plain text this way too: then set source.tls (docs/sources/tls.md)"
            } else {
                "check the user and password (source.url, OUTBOXD_SOURCE__PASSWORD or source.password_file); an account created with REQUIRE X509 also needs source.tls.cert and key"
            };
            Error::source(format!("{server} refused the login: {}", se.message)).remedy(fix)
        }
        mysql_async::Error::Server(se) if se.code == ER_BAD_DB => {
            Error::source(format!("{server} refused the connection: {}", se.message))
                .remedy("the database named in source.url does not exist on this server: fix the URL's path")
        }
        mysql_async::Error::Server(se) if se.code == ER_SPECIFIC_ACCESS_DENIED => {
            Error::source(format!("{server}: missing privilege: {}", se.message)).remedy(
                "GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO the outboxd user (MariaDB also BINLOG MONITOR, SLAVE MONITOR)",
            )
        }
        mysql_async::Error::Server(se) if TRANSIENT_SERVER_ERRORS.contains(&se.code) => {
            Error::source(format!("{server}: server error {}: {}", se.code, se.message))
                .remedy("outboxd retries; the server is restarting, overloaded or dropped the connection")
                .transient()
        }
        mysql_async::Error::Server(se) => {
            Error::source(format!("{server}: server error {}: {}", se.code, se.message))
        }
        other => {
            let text = other.to_string();
            // TLS 1.3 reports a refused client certificate on the first read, after the handshake.
            alert_error(&server, &text).unwrap_or_else(|| {
                Error::source(format!("{server}: {text}"))
                    .remedy("outboxd retries; check that the server is up and reachable")
                    .transient()
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::without_tls_keys;

    #[test]
    fn tls_parameters_are_taken_out_of_the_url_the_driver_sees() {
        assert_eq!(
            without_tls_keys("mysql://cdc@db:3306/app?ssl-mode=VERIFY_IDENTITY&ssl-ca=%2Fca.pem"),
            "mysql://cdc@db:3306/app"
        );
        assert_eq!(
            without_tls_keys("mysql://cdc@db:3306/app?ssl-mode=REQUIRED&compression=fast"),
            "mysql://cdc@db:3306/app?compression=fast"
        );
        assert_eq!(without_tls_keys("mysql://cdc@db/app"), "mysql://cdc@db/app");
    }
}
