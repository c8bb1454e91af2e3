//! Postgres source: logical replication through the built-in `pgoutput` plugin.
//!
//! ## Resumption
//! Checkpoints hold a commit's *end LSN* (or a keepalive's WAL end when nothing was open), and a
//! session starts replication at that LSN: Postgres skips transactions that committed before it. The
//! slot's `confirmed_flush_lsn` is advanced only to LSNs already durable in the local checkpoint (the
//! checkpoint's [`Durable`] handle says which), so the server never discards WAL we may still need. A
//! slot ahead of the checkpoint means an older copy of the checkpoint (restored, rewound): the rows
//! in between were forwarded, so we say so and start at the slot. A missing slot, or one ahead of
//! the checkpoint on a server promoted since, no longer holds the changes since the checkpoint (a
//! failover to a server without a copy of the slot, a slot made anew): that is refused, never
//! skipped over. Without a checkpoint the stream starts at the slot's position, which for a slot
//! outboxd just created is "now".
//!
//! ## Failover
//! `source.url` may list the primary and its physical standbys. On 17+ the slot outboxd creates on
//! a primary is a failover slot, which standbys with `sync_replication_slots` keep a copy of; a
//! standby refuses to serve from that copy until it is promoted (its host's refusal, so the next
//! host is tried), and after the promotion the stream continues from it at the checkpoint.
//!
//! ## Liveness
//! With `heartbeat_interval_ms`, outboxd emits a non-transactional `pg_logical_emit_message` on the
//! control connection; it comes back through the stream, so a quiet database still shows progress and a
//! stream that stays silent for three intervals is treated as dead. A standby (read-only) cannot
//! write it: with `source.primary_url` it is written on the primary and replicates through
//! ([`heartbeat`]); without it, or while that primary does not take it, outboxd relies on the
//! walsender's keepalives and allows 100 s of silence. A standby promoted under a session is
//! noticed at the next tick, and writes the heartbeat itself from then on.
//!
//! The wire codec ([`pgoutput`]) lives apart from the connection so it can be tested on captured bytes
//! alone, and the state machine ([`decoder`]) apart from both.

mod control;
mod decoder;
mod heartbeat;
mod lineage;
pub mod lsn;
pub mod pgoutput;
mod preflight;
pub mod prune;
mod published;
pub mod snapshot;
mod socket;
mod stream;
mod values;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;

pub use self::control::{quote_table, ConnInfo, Control};
use self::control::{Server, SlotHolder, SlotState, STANDBY_DECODING};
pub use self::decoder::{position, HEARTBEAT_PREFIX};
use self::decoder::{Decoder, Step};
use self::heartbeat::{Emitted, Heartbeat, KEEPALIVE_SILENCE};
use self::lineage::Lineage;
use self::lsn::lsn_to_string;
pub use self::lsn::Lsn;
pub use self::preflight::preflight;
use self::stream::{Connection, ReplicationStream, System};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::source::config::{PostgresOptions, SourceConfig, SourceKind};
use crate::source::{Change, Durable, Ignored, Position, SourceIdentity};

/// Messages taken from the read buffer, at most, before the silence timer and the source-event gauge
/// are refreshed without a new socket read (a slow sink can hold thousands in one read).
const STAMP_EVERY: u32 = 256;

pub struct PostgresSource {
    stream: ReplicationStream,
    control: Control,
    decoder: Decoder,
    buffer: VecDeque<Change>,
    identity: SourceIdentity,
    start: u64,
    metrics: Arc<Metrics>,
    /// When the next heartbeat is due (`None`: none can be written), and where it goes.
    heartbeat: Option<tokio::time::Interval>,
    beat: Heartbeat,
    /// `source.heartbeat_interval_ms`.
    every: Duration,
    /// When the stream last said anything.
    last_message: tokio::time::Instant,
    /// Messages taken since `last_message` was last set.
    unstamped: u32,
    /// When the silence is looked at next (`last_message + read_timeout()`, or later while the server
    /// shows it is busy for us).
    check_at: tokio::time::Instant,
    /// The walsender's read position at the last look, and when it last moved.
    progress: Option<(u64, tokio::time::Instant)>,
    /// How long a walsender that reads no WAL may stay silent: the server's `wal_sender_timeout`
    /// (it sends a keepalive every half of it while it replays a large transaction to the output
    /// plugin).
    busy_limit: Duration,
}

impl PostgresSource {
    pub async fn connect(
        config: &SourceConfig,
        own: &PostgresOptions,
        resume: Option<(&SourceIdentity, &Position)>,
        metrics: Arc<Metrics>,
        durable: Durable,
    ) -> Result<PostgresSource> {
        let info = ConnInfo::from_config(config)?;
        let control = Control::connect(&info).await?;
        let server = control.server().await?;
        let source = config;
        let mut conn = within(Connection::open(&info), &info.shown).await?;
        let system = within(conn.identify_system(), &info.shown).await?;
        if let Some((stored, position)) = resume {
            same_cluster(stored, &system)?;
            same_history(&mut conn, stored, position, &system, &server, &info).await?;
        }
        let slot = usable_slot(&control, &server, &info, own, config.one_of_several).await?;
        control
            .ensure_publication_on(&server, &own.publication, &source.tables)
            .await?;
        let start = start_position(&control, &server, own, slot, (resume, system.timeline)).await?;
        let heartbeat = Duration::from_millis(source.heartbeat_interval_ms);
        let identity = SourceIdentity {
            kind: SourceKind::Postgres,
            server_id: None,
            server_uuid: None,
            system_identifier: Some(system.id.clone()),
            slot: Some(own.slot.clone()),
            // A standby's timeline can change under a session (a promotion, or following a new
            // primary), and the checkpoints would name the old one: a primary's only.
            timeline: (!server.standby).then_some(system.timeline),
        };
        if durable.fenced_earlier() {
            end_fenced_holder(&control, &own.slot, &info.application_name).await;
        }
        // The slot is confirmed only up to what the local checkpoint holds (`durable`).
        let stream = within(
            conn.start(&own.slot, &own.publication, start, durable),
            &info.shown,
        )
        .await?;
        tracing::info!(
            server = %info.shown,
            slot = %own.slot,
            publication = %own.publication,
            position = %lsn_to_string(start),
            "replication stream opened"
        );
        let partitions = control.outbox_partitions(&source.tables).await?;
        let busy_limit = control
            .wal_sender_timeout()
            .await
            .ok()
            .flatten()
            .unwrap_or(KEEPALIVE_SILENCE);
        let mut ticker = tokio::time::interval(heartbeat);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let beat = Heartbeat::for_server(config, &server, &system.id, heartbeat)?;
        let read_timeout = beat.silence_allowed(heartbeat);
        Ok(PostgresSource {
            stream,
            control,
            decoder: {
                let mut decoder = Decoder::new(
                    start,
                    source.tables.iter().cloned(),
                    own.message_prefixes.iter().cloned(),
                );
                decoder.set_partitions(partitions);
                decoder
            },
            buffer: VecDeque::new(),
            identity,
            start,
            metrics,
            heartbeat: Some(ticker),
            beat,
            every: heartbeat,
            last_message: tokio::time::Instant::now(),
            unstamped: 0,
            check_at: tokio::time::Instant::now() + read_timeout,
            progress: None,
            busy_limit,
        })
    }

    pub fn identity(&self) -> &SourceIdentity {
        &self.identity
    }

    pub fn start(&self) -> Position {
        position(self.start)
    }

    pub fn ignored(&self) -> Ignored {
        self.decoder.ignored()
    }

    pub async fn next(&mut self) -> Result<Change> {
        loop {
            if let Some(change) = self.buffer.pop_front() {
                return Ok(change);
            }
            // Whatever the socket already delivered is taken without building the select below
            // (a read brings many messages; this is the hot path).
            let step = match self.stream.next().now_or_never() {
                Some(frame) => self.decoder.on_frame(frame?, &mut self.buffer)?,
                None => {
                    // About to wait: the silence counts from the last message taken, even one taken
                    // from the buffer long after its read (back-pressure held the reader).
                    if self.unstamped > 0 {
                        self.stamp();
                    }
                    tokio::select! {
                    biased;
                    frame = self.stream.next() => self.decoder.on_frame(frame?, &mut self.buffer)?,
                    _ = tick(&mut self.heartbeat) => {
                        self.emit_heartbeat().await;
                        continue;
                    }
                    // Silence: a message resets it; heartbeats we emit count only once they come
                    // back through the stream. Checked after the stream, so buffered messages are
                    // taken first (after back-pressure held the reader).
                    _ = tokio::time::sleep_until(self.check_at) => {
                        self.on_silence().await?;
                        continue;
                    }
                    }
                }
            };
            // A message resets the silence and the source-event gauge. The clock is read once per
            // socket read (the messages of one read share its time), and at least every
            // `STAMP_EVERY` messages taken from the buffer without a read.
            self.unstamped += 1;
            if self.stream.took_read() || self.unstamped >= STAMP_EVERY {
                self.stamp();
            }
            self.progress = None;
            if let Step::NeedAncestors { relation_id, name } = step {
                let ancestors = tokio::time::timeout(
                    Duration::from_secs(30),
                    self.control.partition_ancestors(relation_id),
                )
                .await
                .map_err(|_| {
                    Error::source(format!(
                        "looking up whether {name} is a partition of an outbox table took longer than 30 s"
                    ))
                    .remedy("outboxd reconnects by itself")
                    .transient()
                })??;
                tracing::debug!(relation = %name, ?ancestors, "relation resolved");
                self.decoder.resolve_relation(relation_id, ancestors)?;
            }
        }
    }

    /// A message was taken now: the silence starts over.
    fn stamp(&mut self) {
        self.last_message = tokio::time::Instant::now();
        self.check_at = self.last_message + self.read_timeout();
        self.metrics.source_event();
        self.unstamped = 0;
    }

    /// How long the stream may say nothing before [`Self::on_silence`] looks at it (it changes
    /// while the primary of a standby read cannot take the heartbeat).
    fn read_timeout(&self) -> Duration {
        self.beat.silence_allowed(self.every)
    }

    /// Writes the heartbeat message here (the primary of a standby read gets it from a task of its
    /// own); it comes back through the stream.
    async fn emit_heartbeat(&mut self) {
        if let Emitted::Cannot(e) = self.beat.emit(&self.control).await {
            tracing::warn!(error = %e, "cannot emit heartbeat messages: relying on walsender keepalives");
            self.heartbeat = None;
            self.beat = Heartbeat::Off;
            self.check_at = self.check_at.max(self.last_message + self.read_timeout());
        }
    }

    /// The stream said nothing for a while. Silence alone does not tell a dead stream from a server
    /// busy for us (decoding a multi-million-row transaction of another table sends nothing until it
    /// is done), so ask the server on the control connection. No answer, or no walsender on our
    /// slot: dead. A walsender whose read position (`pg_stat_replication.sent_lsn`, visible with
    /// `pg_read_all_stats`) moves is working through WAL for us: wait. One that does not move (or
    /// whose position is hidden) may be replaying one large transaction to the output plugin, which
    /// sends a keepalive every half `wal_sender_timeout`; it gets that long since it last moved,
    /// then it is dead (a frozen walsender ends up here).
    async fn on_silence(&mut self) -> Result<()> {
        let now = tokio::time::Instant::now();
        let silent = now - self.last_message;
        let allowed = self.read_timeout();
        if silent < allowed {
            // More is allowed than when this look was set (the primary stopped taking heartbeats):
            // the walsender's progress is measured afresh from the next look.
            self.check_at = self.last_message + allowed;
            self.progress = None;
            return Ok(());
        }
        let dead = |why: String| {
            Err(Error::source(format!(
                "no replication message or heartbeat for {silent:?}; {why}; the stream is treated as dead"
            ))
            .remedy("outboxd reconnects by itself; if this repeats, check the network path to the server")
            .transient())
        };
        let slot = self.identity.slot.clone().unwrap_or_default();
        let asked = tokio::time::timeout(allowed, self.control.walsender_sent_lsn(&slot)).await;
        let sent = match asked {
            Ok(Ok(Some(sent))) => sent,
            Ok(Ok(None)) => return dead("the server shows no walsender on our slot".into()),
            Ok(Err(e)) => return dead(format!("asking the server about it failed: {e}")),
            Err(_) => {
                return dead("the server did not answer on the control connection either".into())
            }
        };
        let moved = match (self.progress, sent) {
            (None, _) => true,
            (Some((before, _)), Some(lsn)) => lsn > before,
            (Some(_), None) => false,
        };
        if self.progress.is_none() {
            tracing::info!(
                silent = ?silent,
                sent_lsn = %sent.map(lsn_to_string).unwrap_or_else(|| "hidden (no pg_read_all_stats)".into()),
                allowed = ?self.busy_limit,
                "the replication stream is silent, but the server's walsender for our slot is alive (decoding a large transaction?): waiting"
            );
        }
        if moved {
            self.progress = Some((sent.unwrap_or(0), now));
        }
        let last_progress = self.progress.map(|(_, at)| at).unwrap_or(now);
        if now - last_progress > self.busy_limit + allowed {
            return dead(format!(
                "the walsender has shown no progress for {:?}",
                now - last_progress
            ));
        }
        self.check_at = now + allowed;
        Ok(())
    }
}

/// The slot on this server, if it has one outboxd may read here. A standby is read only from 16
/// on, and not through a synchronized copy of the primary's failover slot (17+): that copy is for
/// after a promotion (Postgres refuses to decode from it before). Both are this host's refusal, so
/// a `source.url` listing the primary and its standbys moves on to the next host.
async fn usable_slot(
    control: &Control,
    server: &Server,
    info: &ConnInfo,
    own: &PostgresOptions,
    several: bool,
) -> Result<Option<SlotState>> {
    let slot = control.slot(&own.slot).await?;
    if !server.standby {
        return Ok(slot);
    }
    if server.number < STANDBY_DECODING {
        return Err(Error::source(format!(
            "{} is a standby (in recovery) of PostgreSQL {}, which cannot decode logically: that came in PostgreSQL 16",
            info.shown, server.version
        ))
        .remedy("point source.url at the primary (list it first, with its standbys after it for failover), or upgrade to 16 or later to read a standby")
        .refused_by_host());
    }
    if slot.as_ref().is_some_and(|s| s.synced) {
        return Err(Error::source(format!(
            "{} is a standby, and its slot {} is a synchronized copy of the primary's failover slot: Postgres lets it be read only once this standby is promoted",
            info.shown, own.slot
        ))
        .remedy("list the primary in source.url as well: outboxd reads the primary, and continues on this standby from the copy after a promotion")
        .refused_by_host());
    }
    if several && slot.is_none() {
        // Listed beside its primary, a standby is there for failover: the slot belongs on the
        // primary (a failover slot), not here, where it would also wait for the primary.
        return Err(Error::source(format!(
            "{} is a standby without slot {}: with several hosts in source.url, outboxd makes the slot on the primary, never on a standby",
            info.shown, own.slot
        ))
        .remedy("nothing while the primary is up: outboxd reads it. To read this standby instead, list it alone in source.url")
        .refused_by_host());
    }
    Ok(slot)
}

/// A checkpoint of another cluster is refused: its LSNs mean nothing here.
fn same_cluster(stored: &SourceIdentity, system: &System) -> Result<()> {
    match &stored.system_identifier {
        Some(id) if *id != system.id => Err(Error::checkpoint(format!(
            "the checkpoint was written against Postgres cluster {id:?}, but this is cluster {:?}; its LSNs mean nothing here",
            system.id
        ))
        .remedy("point source.url back at that cluster, or set a position for this one with `outboxd checkpoint set LSN`")),
        _ => Ok(()),
    }
}

/// Refuses a server whose history does not hold the checkpoint (see [`lineage`]): this host's
/// refusal, so another listed host (the current primary) is tried.
async fn same_history(
    conn: &mut Connection,
    stored: &SourceIdentity,
    position: &Position,
    system: &System,
    server: &Server,
    info: &ConnInfo,
) -> Result<()> {
    let (Some(then), Ok(Lsn(lsn))) = (stored.timeline, position.lsn()) else {
        return Ok(());
    };
    let history = if system.timeline > then {
        let asked = within(conn.timeline_history(system.timeline), &info.shown).await;
        // A server that cannot show its history (the file is gone) cannot be vouched for.
        Some(asked.map_err(|e| {
            if e.is_transient() {
                e
            } else {
                e.refused_by_host()
            }
        })?)
    } else {
        None
    };
    let now = system.timeline;
    let refusal = match lineage::judge(then, now, lsn, history.as_deref()) {
        Lineage::Holds => return Ok(()),
        // A standby reports the timeline it has replayed: it may not have reached the switch yet.
        Lineage::Behind if server.standby => {
            return Err(Error::source(format!(
                "{} is a standby still replaying timeline {now}; the checkpoint was written on timeline {then}",
                info.shown
            ))
            .remedy("outboxd waits for the standby's replay to reach the newer timeline; if it never does, it follows an old primary: point it at the current one")
            .transient())
        }
        Lineage::Behind => Error::source(format!(
            "{} is on timeline {now}, but the checkpoint was written on timeline {then}: this server is behind a promotion (an old primary that came back, or a standby of one)",
            info.shown
        ))
        .remedy("point source.url at the current primary; a former primary must be rewound (pg_rewind) or rebuilt as a standby before it serves again"),
        Lineage::Forked { at } => Error::source(format!(
            "{} left timeline {then} at {}, before the checkpoint ({}): it never had the changes outboxd forwarded from the old primary after {}, and starting at the checkpoint would skip its own changes up to there",
            info.shown,
            lsn_to_string(at),
            lsn_to_string(lsn),
            lsn_to_string(at)
        ))
        .remedy(format!(
            "`outboxd checkpoint set {}` reads this server from where its history forked (what was forwarded from the old primary after that point is not in its tables; consumers may hold it). Against the next time: synchronized_standby_slots on the primary, naming the standbys' physical slots",
            lsn_to_string(at)
        )),
        Lineage::Unrelated => Error::source(format!(
            "{}'s timeline history (timeline {now}) does not pass through timeline {then}, on which the checkpoint was written",
            info.shown
        ))
        .remedy("point source.url at the cluster the checkpoint belongs to, or set a position for this server with `outboxd checkpoint set LSN`"),
    };
    Err(refusal.refused_by_host())
}

/// Where the stream starts: the checkpoint's LSN on the slot that kept the changes since it, or,
/// without a checkpoint, the slot's position (created now if missing: "now").
///
/// With a checkpoint, a missing slot is refused (this host's refusal): the changes since the
/// checkpoint went with it, and a new slot would skip them without a word. So is a slot ahead of
/// the checkpoint on a server promoted since (made there after the checkpoint); on the server the
/// checkpoint was written on, a slot ahead of it means an older copy of the checkpoint, and the
/// stream starts at the slot with a warning. The remedy says how to re-send or accept.
async fn start_position(
    control: &Control,
    server: &Server,
    own: &PostgresOptions,
    slot: Option<SlotState>,
    (resume, timeline): (Option<(&SourceIdentity, &Position)>, u32),
) -> Result<u64> {
    let Some((stored, position)) = resume else {
        let lsn = match slot {
            Some(s) => s.confirmed,
            None => control.create_slot(&own.slot, server).await?,
        };
        tracing::warn!(
            slot = %own.slot,
            lsn = %lsn_to_string(lsn),
            "no checkpoint: starting at the slot's position (for a new slot: now)"
        );
        return Ok(lsn);
    };
    if stored.kind != SourceKind::Postgres {
        return Err(Error::checkpoint(format!(
            "the checkpoint belongs to a {} source, but source.kind is postgres",
            stored.kind.as_str()
        ))
        .remedy("point checkpoint.dir or name at this source's checkpoint"));
    }
    if let Some(name) = stored.slot.as_deref().filter(|s| *s != own.slot) {
        return Err(Error::checkpoint(format!(
            "the checkpoint was written for replication slot {name}, but own.slot is {}",
            own.slot
        ))
        .remedy("set own.slot back, or `outboxd checkpoint reset` to start the new slot at the current end"));
    }
    let lsn = position.lsn()?.0;
    let resend = "the rows are still in the outbox tables unless pruned: `outboxd snapshot --where \"created_at >= '…'\"` re-sends them with their ids (take a time well before the checkpoint's `updated_at` in `outboxd checkpoint show`: a row's created_at is when its transaction wrote it, not when it committed)";
    let Some(slot) = slot else {
        return Err(Error::source(format!(
            "replication slot {} does not exist on this server, but a checkpoint does (at {}): the changes since then went with the slot (dropped, or a failover to a server that had no synchronized copy of it)",
            own.slot,
            lsn_to_string(lsn)
        ))
        .remedy(format!(
            "if the slot is on another server of this cluster, list that server in source.url. Otherwise: `outboxd checkpoint reset` and start outboxd (it makes a new slot at the current end), then re-send what came before it: {resend}. Against the next failover: PostgreSQL 17+ keeps a failover slot on standbys with sync_replication_slots = on (see the Postgres source guide)"
        ))
        .refused_by_host());
    };
    if let Some(why) = &slot.invalidated {
        return Err(Error::source(format!(
            "replication slot {} is invalidated ({why}): Postgres removed WAL or catalog rows it needed, so the changes since the checkpoint cannot be decoded from it",
            own.slot
        ))
        .remedy(format!(
            "drop it (SELECT pg_drop_replication_slot('{}')), `outboxd checkpoint reset` and start outboxd, then re-send what came before: {resend}. Against it: max_slot_wal_keep_size large enough, hot_standby_feedback on standbys",
            own.slot
        ))
        .refused_by_host());
    }
    // On the server the checkpoint was written on, a slot ahead of it was confirmed by outboxd
    // itself (only ever up to a durable checkpoint) and the checkpoint is an older copy (restored,
    // or rewound by hand): the rows in between were forwarded, and the server cannot go back. After
    // a promotion (another timeline) the slot was made there after the checkpoint.
    let promoted = stored.timeline.is_some_and(|t| t != timeline);
    if slot.confirmed > lsn && !promoted {
        tracing::warn!(
            checkpoint = %lsn_to_string(lsn),
            slot = %lsn_to_string(slot.confirmed),
            "the slot is ahead of the checkpoint (an older copy of the checkpoint, or the slot was consumed elsewhere): starting at the slot, the server cannot go back"
        );
        return Ok(slot.confirmed);
    }
    if slot.confirmed > lsn {
        return Err(Error::source(format!(
            "replication slot {} starts at {}, after the checkpoint ({}), on a server promoted since the checkpoint: the slot was made here after it, and the changes in between are not in it",
            own.slot,
            lsn_to_string(slot.confirmed),
            lsn_to_string(lsn)
        ))
        .remedy(format!(
            "{resend}; then accept the gap with `outboxd checkpoint set {}`. Give each pipeline its own source.slot",
            lsn_to_string(slot.confirmed)
        ))
        .refused_by_host());
    }
    Ok(lsn)
}

async fn tick(ticker: &mut Option<tokio::time::Interval>) {
    match ticker {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// A handshake step, within 30 s (a server that accepts TCP but never answers must not hang us).
async fn within<T>(step: impl std::future::Future<Output = Result<T>>, server: &str) -> Result<T> {
    match tokio::time::timeout(Duration::from_secs(30), step).await {
        Ok(result) => result,
        Err(_) => Err(Error::source(format!(
            "{server} did not answer the replication handshake within 30 s"
        ))
        .transient()),
    }
}

/// The server's current WAL position, for `replay` and tests.
pub async fn current_end_position(config: &SourceConfig) -> Result<Position> {
    let (_, control) = Control::connect_primary(config).await?;
    Ok(position(control.current_lsn().await?))
}

/// Parses `0/16B3748`.
pub fn parse_position(text: &str) -> Result<Position> {
    lsn::parse_lsn(text.trim()).map(position).ok_or_else(|| {
        Error::config(format!("{text:?} is not a Postgres LSN"))
            .remedy("write an LSN like 0/16B3748")
    })
}

/// Postgres lets one connection use a slot. A leader that was frozen (or cut off) rather than
/// killed keeps its walsender until `wal_sender_timeout` (60 s by default, possibly off), and the
/// new leader could not stream until then. The lead fenced that instance already (it can no
/// longer commit a checkpoint), so its connection is ended, if it is outboxd's: the same role and
/// `application_name` as this one. Anything else (another tool, another role, a refusal) is left
/// to the server: the stream's start is retried until the slot is free, as before.
async fn end_fenced_holder(control: &Control, slot: &str, ours: &str) {
    match control
        .end_slot_holder(slot, ours, Duration::from_secs(3))
        .await
    {
        Ok(SlotHolder::Free) => {}
        Ok(SlotHolder::Ended { pid }) => tracing::warn!(
            slot = %slot,
            pid,
            "the replication slot was held by another connection of this pipeline (an earlier instance, fenced when this one took the lead): ended it"
        ),
        Ok(SlotHolder::Gone { pid }) => {
            tracing::info!(slot = %slot, pid, "the connection holding the replication slot had gone already")
        }
        Ok(SlotHolder::StillHeld { pid }) => tracing::warn!(
            slot = %slot,
            pid,
            "the connection holding the replication slot was told to end but still holds it; retrying until the server frees the slot"
        ),
        Ok(SlotHolder::NotOurs { pid, name }) => tracing::warn!(
            slot = %slot,
            pid,
            application_name = ?name,
            "the replication slot is held by a connection that is not this pipeline's (another role or application_name): left alone; retrying until it lets go (is another program, or pipeline, using the slot?)"
        ),
        Err(e) => tracing::warn!(
            error = %e,
            "could not end the connection holding the replication slot; retrying until the server frees the slot"
        ),
    }
}
