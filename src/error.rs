//! The one error type of outboxd.
//!
//! Every error says *what* broke (its [`Kind`]), a message naming the thing (a file, a config key, a
//! server), and a remedy the user can act on. Whether the pipeline reconnects or exits depends only on
//! [`Error::is_transient`]: network and delivery trouble is retried from the last durable checkpoint,
//! anything that a retry cannot fix (bad config, a corrupt checkpoint, an event we cannot decode) ends the
//! process with a non-zero status. Secrets never reach these strings: URLs are redacted before they are
//! formatted into a message (see [`crate::source::config::redact_url`]).
//!
//! The driver error behind one (mysql_async, tokio-postgres, librdkafka) stays attached as its
//! [`std::error::Error::source`], for programs and logs that walk the chain; the message already
//! says in words what it means.

use std::fmt;
use std::sync::Arc;

/// Which stage broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The configuration file, an environment override or the command line.
    Config,
    /// The database log reader (connection, protocol, decoding).
    Source,
    /// The Kafka producer.
    Sink,
    /// The checkpoint store (a local file, or the checkpoint topic) and the pipeline's lead.
    Checkpoint,
    /// A row the router cannot turn into a valid Kafka record.
    Unroutable,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Config => "config",
            Kind::Source => "source",
            Kind::Sink => "sink",
            Kind::Checkpoint => "checkpoint",
            Kind::Unroutable => "unroutable",
        })
    }
}

/// An error with a kind, a message and a remedy.
#[derive(Debug, Clone)]
pub struct Error {
    kind: Kind,
    message: String,
    remedy: Option<String>,
    transient: bool,
    /// Another instance of the pipeline took over (its fencing refused this one's write).
    superseded: bool,
    /// The source host refuses to serve outboxd (a setting, a grant, the checkpoint's binlog gone
    /// there): another host of a multi-host `source.url` may serve it.
    host_refusal: bool,
    cause: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    fn new(kind: Kind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            remedy: None,
            transient: false,
            superseded: false,
            host_refusal: false,
            cause: None,
        }
    }

    pub fn config(message: impl Into<String>) -> Self {
        Self::new(Kind::Config, message)
    }

    pub fn source(message: impl Into<String>) -> Self {
        Self::new(Kind::Source, message)
    }

    pub fn sink(message: impl Into<String>) -> Self {
        Self::new(Kind::Sink, message)
    }

    pub fn checkpoint(message: impl Into<String>) -> Self {
        Self::new(Kind::Checkpoint, message)
    }

    pub fn unroutable(message: impl Into<String>) -> Self {
        Self::new(Kind::Unroutable, message)
    }

    /// Adds the action that fixes this error.
    pub fn remedy(mut self, remedy: impl Into<String>) -> Self {
        self.remedy = Some(remedy.into());
        self
    }

    /// Keeps the driver error this one explains, as its `source()`.
    pub fn caused_by(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.cause = Some(Arc::new(cause));
        self
    }

    /// Marks the error as one a reconnect may cure (network, broker outage, server restart).
    pub fn transient(mut self) -> Self {
        self.transient = true;
        self
    }

    /// Marks the error as "another instance leads this pipeline now": this one stands by again.
    pub fn superseded(mut self) -> Self {
        self.superseded = true;
        self
    }

    pub fn is_superseded(&self) -> bool {
        self.superseded
    }

    /// Marks the error as this source host's refusal (see `pipeline::hosts`).
    pub fn refused_by_host(mut self) -> Self {
        self.host_refusal = true;
        self
    }

    pub fn is_host_refusal(&self) -> bool {
        self.host_refusal
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn remedy_text(&self) -> Option<&str> {
        self.remedy.as_deref()
    }

    pub fn is_transient(&self) -> bool {
        self.transient
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} error: {}", self.kind, self.message)?;
        if let Some(remedy) = &self.remedy {
            write!(f, "\n  remedy: {remedy}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driver_error_stays_attached_as_the_source() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let e = Error::source("the replication connection failed")
            .transient()
            .caused_by(io);
        let cause = std::error::Error::source(&e).expect("a source");
        assert_eq!(cause.to_string(), "reset by peer");
        assert!(std::error::Error::source(&Error::config("x")).is_none());
    }
}
