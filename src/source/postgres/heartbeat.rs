//! Where outboxd's heartbeat message is written, and the `check` lines about it.
//!
//! The heartbeat is a non-transactional `pg_logical_emit_message` that comes back through the
//! stream: a quiet database still shows progress end to end (the silence timer, `/readyz`, and a
//! slot confirmed past the primary's WAL). A primary writes it on the control connection. A standby
//! cannot write; with `source.primary_url` the message is written on the primary it follows,
//! replicates to the standby and is decoded there like any other record. Without it a standby
//! relies on walsender keepalives, which come only while WAL moves: on a quiet primary the stream
//! says nothing, so readiness fails and the stream is reconnected every few minutes (`check` says
//! so).
//!
//! The primary's heartbeats are written by a task of their own, so a primary that is slow, gone or
//! blackholed never holds up reading the standby: the heartbeat then pauses (one WARN), and
//! resumes when the primary answers again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::control::{ConnInfo, Control, Server};
use super::stream::Connection;
use crate::error::{Error, Result};
use crate::preflight::Item;
use crate::source::config::{redact_url, PostgresOptions, SourceConfig};

/// How long one heartbeat (a connection to the primary included) may take.
const EMIT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long asking the standby read whether it was promoted may hold up reading it.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Silence allowed when no heartbeat comes back (walsender keepalives come every 30 s by default).
pub const KEEPALIVE_SILENCE: Duration = Duration::from_secs(100);

/// Where this session writes its heartbeat.
pub enum Heartbeat {
    /// On the server read (a primary).
    Here,
    /// On the primary the standby read follows (`source.primary_url`), by a task of its own: a
    /// primary that is slow or gone never holds up reading the stream. `failing` is set while it
    /// cannot be written: no heartbeat comes back then, and the stream's silence is judged as
    /// without one.
    OnPrimary {
        _task: Beating,
        failing: Arc<AtomicBool>,
    },
    /// Nowhere: a standby without `source.primary_url`, or a server that refused it.
    Off,
}

/// The task writing heartbeats on the primary; it ends with the session (dropped).
pub struct Beating(tokio::task::JoinHandle<()>);

impl Drop for Beating {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Primary {
    info: ConnInfo,
    /// The system identifier of the standby read: a primary of another cluster is refused.
    cluster: String,
    control: Option<Control>,
    /// Whether the last attempt failed (a WARN was logged; the next success is logged too).
    failing: Arc<AtomicBool>,
}

/// What [`Heartbeat::emit`] found.
pub enum Emitted {
    /// Written (or skipped for now: the primary is away, and was said to be).
    Fine,
    /// This server cannot write it (read-only): rely on keepalives from now on.
    Cannot(Error),
}

impl Heartbeat {
    /// The heartbeat for a session on `server` (of the cluster `cluster`), every `every`.
    pub fn for_server(
        config: &SourceConfig,
        server: &Server,
        cluster: &str,
        every: Duration,
    ) -> Result<Heartbeat> {
        if !server.standby {
            return Ok(Heartbeat::Here);
        }
        let Some(primary) = config.primary() else {
            tracing::warn!(
                "reading a standby without source.primary_url: a standby cannot write outboxd's heartbeat, so while the primary is quiet the stream says nothing (readiness fails, and the stream is reconnected every few minutes); set source.primary_url to the primary"
            );
            return Ok(Heartbeat::Off);
        };
        let info = ConnInfo::from_config(&primary)?;
        tracing::info!(primary = %info.shown, "reading a standby: the heartbeat is written on the primary");
        let failing = Arc::new(AtomicBool::new(false));
        let mut primary = Primary {
            info,
            cluster: cluster.to_string(),
            control: None,
            failing: failing.clone(),
        };
        Ok(Heartbeat::OnPrimary {
            _task: Beating(tokio::spawn(async move {
                let mut ticker = tokio::time::interval(every);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticker.tick().await;
                    if !primary.emit().await {
                        break;
                    }
                }
            })),
            failing,
        })
    }

    /// How long the stream may say nothing before it is looked at: three heartbeat intervals while
    /// heartbeats come back, the walsender's keepalive rhythm while none can.
    pub fn silence_allowed(&self, every: Duration) -> Duration {
        let beating = match self {
            Heartbeat::Here => true,
            Heartbeat::OnPrimary { failing, .. } => !failing.load(Ordering::Relaxed),
            Heartbeat::Off => false,
        };
        if beating {
            every * 3
        } else {
            KEEPALIVE_SILENCE.max(every * 3)
        }
    }

    /// The session's tick: writes one heartbeat on `local`'s server (a primary's), or, while a
    /// standby is read, looks whether it was promoted: from then on it writes its own.
    pub async fn emit(&mut self, local: &Control) -> Emitted {
        if !matches!(self, Heartbeat::Here) {
            // On the read path: a short bound, and none at all on a connection known gone (the
            // silence check ends such a session); a promotion missed here is seen next session.
            if local.is_closed() {
                return Emitted::Fine;
            }
            match tokio::time::timeout(PROBE_TIMEOUT, local.server()).await {
                Ok(Ok(server)) if !server.standby => {
                    tracing::info!(
                        "the standby read was promoted: the heartbeat is written on it from now on"
                    );
                    *self = Heartbeat::Here;
                }
                Ok(Ok(_)) => return Emitted::Fine,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "could not ask whether the standby read was promoted");
                    return Emitted::Fine;
                }
                Err(_) => {
                    tracing::debug!("asking whether the standby read was promoted timed out");
                    return Emitted::Fine;
                }
            }
        }
        match tokio::time::timeout(EMIT_TIMEOUT, local.emit_heartbeat()).await {
            Ok(Ok(())) => Emitted::Fine,
            // A dropped connection is the silence check's to act on; try again next tick.
            Ok(Err(e)) if e.is_transient() => {
                tracing::warn!(error = %e, "emitting the heartbeat message failed");
                Emitted::Fine
            }
            Ok(Err(e)) => Emitted::Cannot(e),
            Err(_) => {
                tracing::warn!("emitting the heartbeat message timed out");
                Emitted::Fine
            }
        }
    }
}

/// The system identifier of `control`'s cluster: from `pg_control_system()`, else (where it is
/// revoked) from a replication connection's IDENTIFY_SYSTEM; `None` when neither answers.
pub async fn cluster_of(info: &ConnInfo, control: &Control) -> Option<String> {
    if let Ok(id) = control.system_identifier().await {
        return Some(id);
    }
    let mut conn = Connection::open(info).await.ok()?;
    let id = conn.identify_system().await.ok().map(|system| system.id);
    conn.close().await;
    id
}

impl Primary {
    /// One heartbeat on the primary; false after a permanent error (a refused login, a standby or
    /// another cluster named as the primary), which is not retried before the next session.
    async fn emit(&mut self) -> bool {
        let outcome = tokio::time::timeout(EMIT_TIMEOUT, self.try_emit()).await;
        let (failure, permanent) = match outcome {
            Ok(Ok(())) => (None, false),
            Ok(Err(e)) => (Some(e.to_string()), !e.is_transient()),
            Err(_) => (Some(format!("no answer within {EMIT_TIMEOUT:?}")), false),
        };
        let failing = self.failing.load(Ordering::Relaxed);
        match (failure, failing) {
            (None, true) => {
                tracing::info!(primary = %self.info.shown, "the heartbeat is written on the primary again");
                self.failing.store(false, Ordering::Relaxed);
            }
            (Some(why), _) if permanent => {
                tracing::warn!(
                    primary = %self.info.shown,
                    error = %why,
                    "cannot write the heartbeat on source.primary_url, and retrying will not help: the standby is still read, but while the primary is quiet the stream says nothing; fix source.primary_url (outboxd check says what is wrong)"
                );
                self.failing.store(true, Ordering::Relaxed);
                return false;
            }
            (Some(why), false) => {
                tracing::warn!(
                    primary = %self.info.shown,
                    error = %why,
                    "cannot write the heartbeat on source.primary_url: the standby is still read, but while the primary is quiet the stream says nothing; outboxd keeps trying"
                );
                self.failing.store(true, Ordering::Relaxed);
                self.control = None;
            }
            (Some(_), true) => self.control = None,
            (None, false) => {}
        }
        true
    }

    async fn try_emit(&mut self) -> Result<()> {
        if self.control.as_ref().is_none_or(Control::is_closed) {
            let control = Control::connect(&self.info).await?;
            // Retried: during a switchover the name may point at a standby for a while.
            if control.server().await?.standby {
                return Err(Error::config(format!(
                    "source.primary_url {} is in recovery (a standby): a standby cannot write the heartbeat",
                    self.info.shown
                ))
                .transient());
            }
            match cluster_of(&self.info, &control).await {
                Some(id) if id != self.cluster => {
                    return Err(Error::config(format!(
                        "source.primary_url {} is another cluster (system identifier {id}, the standby read is {}): its heartbeat never reaches the standby",
                        self.info.shown, self.cluster
                    )));
                }
                Some(_) => {}
                None => tracing::info!(
                    primary = %self.info.shown,
                    "whether source.primary_url is the standby's own cluster is not verified: neither pg_control_system() nor a replication connection answers there"
                ),
            }
            self.control = Some(control);
        }
        let control = self.control.as_ref().expect("connected above");
        control.emit_heartbeat().await
    }
}

/// `check`'s lines about the heartbeat of a session on `server` (reached through `local`).
pub async fn items(
    config: &SourceConfig,
    own: &PostgresOptions,
    server: &Server,
    local: &Control,
    subject: &'static str,
) -> Vec<Item> {
    let Some(url) = &own.primary_url else {
        if !server.standby {
            return Vec::new();
        }
        return vec![Item::warn(
            subject,
            "this server is a standby and source.primary_url is not set: a standby cannot write outboxd's heartbeat, so while the primary is quiet the stream says nothing (/readyz answers 503, and the stream is reconnected every few minutes)",
            "set source.primary_url to the primary this standby follows (postgres://USER@PRIMARY:5432/DB; the password of source.password or password_file, else its own; without parameters of its own it takes source.url's, TLS included)",
        )];
    };
    let shown = redact_url(url);
    if !server.standby {
        return vec![Item::pass(
            subject,
            format!("source.primary_url ({shown}) is not used: source.url is a primary, which writes the heartbeat itself"),
        )];
    }
    let system = match ConnInfo::from_config(config) {
        Ok(info) => tokio::time::timeout(Duration::from_secs(15), cluster_of(&info, local))
            .await
            .ok()
            .flatten(),
        Err(_) => None,
    };
    let system = system.as_deref();
    let reached = async {
        let primary = config.primary().expect("primary_url is set");
        let info = ConnInfo::from_config(&primary)?;
        let control = Control::connect(&info).await?;
        let primary = control.server().await?;
        let id = cluster_of(&info, &control).await;
        Ok::<_, Error>((primary, id))
    };
    match tokio::time::timeout(Duration::from_secs(15), reached).await {
        Err(_) => vec![Item::warn(
            subject,
            format!("source.primary_url {shown} did not answer within 15 s: the standby is read, but without a heartbeat while the primary is quiet"),
            "start the primary or fix source.primary_url",
        )],
        Ok(Err(e)) if e.is_transient() => vec![Item::warn(
            subject,
            format!("source.primary_url: {}: the standby is read, but without a heartbeat while the primary is quiet", e.message()),
            "start the primary or fix source.primary_url",
        )],
        Ok(Err(e)) => vec![Item::fail(
            subject,
            format!("source.primary_url: {}", e.message()),
            e.remedy_text().unwrap_or("fix source.primary_url").to_string(),
        )],
        Ok(Ok((primary, _))) if primary.standby => vec![Item::fail(
            subject,
            format!("source.primary_url {shown} is a standby too: only a primary can write the heartbeat"),
            "set source.primary_url to the primary (the server not in recovery)",
        )],
        Ok(Ok((_, Some(id)))) if system.is_some_and(|here| here != id) => vec![Item::fail(
            subject,
            format!("source.primary_url {shown} is another cluster (system identifier {id}, this standby's is {}): its heartbeat never reaches this standby", system.unwrap_or_default()),
            "set source.primary_url to the primary this standby replicates from",
        )],
        Ok(Ok((_, Some(_)))) if system.is_some() => vec![Item::pass(
            subject,
            format!("the heartbeat is written on the primary {shown} (the same cluster) and comes back through this standby"),
        )],
        Ok(Ok(_)) => vec![Item::pass(
            subject,
            format!("the heartbeat is written on the primary {shown} and comes back through this standby (whether it is the same cluster is not verified: the system identifier is not readable there or here)"),
        )],
    }
}
