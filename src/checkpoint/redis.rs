//! The Redis store: the checkpoint as a key in the same Redis as the streams, so the Redis sink
//! can commit it in the same `MULTI`/`EXEC` as the entries it covers (exactly-once).
//!
//! Keys: `outboxd:checkpoint:NAME` holds the live checkpoint (the same JSON as the file store's),
//! the hash `outboxd:checkpoint:NAME:saved` holds saved copies by label. A user's ACL needs
//! `~outboxd:checkpoint:*` besides the stream keys.
//!
//! *Fencing*: there is no lock. Every commit of a running pipeline is a compare-and-set: the sink
//! `WATCH`es the live key and reads it before `MULTI`, and writes entries and checkpoint only if
//! it still holds what this instance last read or wrote ([`RedisStore::expected`]); otherwise it
//! applies nothing and the instance stops. So a second instance, an instance that was frozen
//! while another took over, or `checkpoint set` while one runs can cost the loser its session,
//! never a duplicate or a lost row. This module owns what the instance expects; the sink
//! (`sink::redis::transaction`) owns the compare.
//!
//! Commands run on a blocking connection (the store's callers run off the async workers), each
//! bounded by [`TIMEOUT`]; a broken connection is made again on the next call.

use std::sync::Mutex;
use std::time::Duration;

use redis::Commands;

use super::store::{Backend, Slot};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::source::config::redact_url;

/// How long one command may take before it is a (transient) error.
const TIMEOUT: Duration = Duration::from_secs(15);

/// Every key of the Redis store starts with this (the sink owns the name: it never writes a
/// stream there).
const KEY_PREFIX: &str = crate::sink::redis::CHECKPOINT_KEY_PREFIX;

/// The live checkpoint's key for pipeline `name`.
pub fn live_key(name: &str) -> String {
    format!("{KEY_PREFIX}{name}")
}

pub struct RedisStore {
    client: redis::Client,
    shown: String,
    live: String,
    saved: String,
    connection: Mutex<Option<redis::Connection>>,
    /// What this instance last read (to resume from) or wrote as the live checkpoint: a commit
    /// applies only while Redis still holds it.
    expected: Mutex<Option<Vec<u8>>>,
    /// The body of the commit in flight, which becomes `expected` once it is applied.
    pending: Mutex<Option<Vec<u8>>>,
    /// The body of a commit that was in flight when its session ended: it may still land.
    uncertain: Mutex<Option<Vec<u8>>>,
    /// Every first checkpoint this process tried to write (an answer may have been lost; each
    /// attempt's `updated_at` makes its bytes its own).
    first: Mutex<Vec<Vec<u8>>>,
    /// `redis.wait_replicas` and the time `WAIT` may take.
    wait_replicas: u32,
    wait_timeout: Duration,
}

impl RedisStore {
    /// The store of pipeline `name` in the `[redis]` section's server (no round trip yet).
    pub fn open(config: &Config, name: &str) -> Result<RedisStore> {
        let redis = config.redis.as_ref().ok_or_else(|| {
            Error::config("checkpoint.store = \"redis\" needs the [redis] section's server")
                .remedy("use checkpoint.store = \"file\" with this sink")
        })?;
        Ok(RedisStore {
            client: crate::sink::redis::client(redis)?,
            shown: redact_url(&redis.url),
            live: live_key(name),
            saved: format!("{}:saved", live_key(name)),
            connection: Mutex::new(None),
            expected: Mutex::new(None),
            pending: Mutex::new(None),
            uncertain: Mutex::new(None),
            first: Mutex::new(Vec::new()),
            wait_replicas: redis.wait_replicas,
            // Within the connection's own read timeout, so a short count is named as such.
            wait_timeout: redis
                .message_timeout()
                .min(TIMEOUT.saturating_sub(Duration::from_secs(3))),
        })
    }

    /// The live checkpoint's key (where a commit writes it).
    pub fn key(&self) -> &str {
        &self.live
    }

    /// What Redis must still hold for this instance's next commit to apply.
    pub fn expected(&self) -> Option<Vec<u8>> {
        self.expected.lock().expect("store lock").clone()
    }

    /// This instance read or wrote `body` as the live checkpoint.
    pub fn expect(&self, body: Option<Vec<u8>>) {
        *self.expected.lock().expect("store lock") = body;
    }

    /// A commit carrying `body` is about to be sent; returns the body of an earlier one whose
    /// outcome is unknown.
    pub fn committing(&self, body: Vec<u8>) -> Option<Vec<u8>> {
        *self.pending.lock().expect("store lock") = Some(body);
        self.uncertain.lock().expect("store lock").clone()
    }

    /// The commit in flight was applied: its body is what Redis holds now.
    pub fn committed(&self) {
        if let Some(body) = self.pending.lock().expect("store lock").take() {
            self.expect(Some(body));
        }
        *self.uncertain.lock().expect("store lock") = None;
    }

    /// The live checkpoint a session resumes from: remembered for the first commit's compare,
    /// and, with `redis.wait_replicas`, on that many replicas before it counts as durable (an
    /// earlier session's last commit may have reached only the primary; a Postgres slot must
    /// never be confirmed past what a failover could take back). A commit still in flight from
    /// the earlier session becomes uncertain.
    pub fn resume(&self) -> Result<Option<Vec<u8>>> {
        let body: Option<Vec<u8>> = self.with("reading", |c| c.get(&self.live))?;
        if self.wait_replicas > 0 {
            self.replicated()?;
        }
        if let Some(pending) = self.pending.lock().expect("store lock").take() {
            *self.uncertain.lock().expect("store lock") = Some(pending);
        }
        self.expect(body.clone());
        Ok(body)
    }

    /// Every write Redis had applied when this returns is on `redis.wait_replicas` replicas: a
    /// write of this connection (`WAIT` counts a client's own writes, and replication keeps one
    /// order), then `WAIT`.
    fn replicated(&self) -> Result<()> {
        let marker = format!("{}:replicated", self.live);
        let millis = self.wait_timeout.as_millis().min(u64::MAX as u128) as u64;
        let reached: i64 = self.with("waiting for replicas of", |c| {
            c.set::<_, _, ()>(&marker, chrono::Utc::now().to_rfc3339())?;
            redis::cmd("WAIT")
                .arg(self.wait_replicas)
                .arg(millis)
                .query(c)
        })?;
        if reached < i64::from(self.wait_replicas) {
            return Err(Error::checkpoint(format!(
                "only {reached} of redis.wait_replicas = {} replicas have the checkpoint at {}",
                self.wait_replicas, self.live
            ))
            .remedy("outboxd retries; check the replicas (INFO replication)")
            .transient());
        }
        Ok(())
    }

    /// Writes the first checkpoint only if there is none (`SET … NX`): another instance that
    /// wrote one meanwhile makes this one stop instead of overwriting it.
    pub fn write_first(&self, body: &[u8]) -> Result<()> {
        self.first.lock().expect("store lock").push(body.to_vec());
        let set: Option<String> = self.with("writing", |c| {
            redis::cmd("SET")
                .arg(&self.live)
                .arg(body)
                .arg("NX")
                .query(c)
        })?;
        if set.is_some() {
            self.expect(Some(body.to_vec()));
            return Ok(());
        }
        // Refused. This process's own earlier first write (its answer lost) may have landed
        // late: then the next session resumes from it.
        let now: Option<Vec<u8>> = self.with("reading", |c| c.get(&self.live))?;
        let mine = now
            .as_ref()
            .is_some_and(|now| self.first.lock().expect("store lock").contains(now));
        if mine {
            return Err(Error::checkpoint(format!(
                "an earlier first checkpoint of this instance reached {} late",
                self.live
            ))
            .remedy("outboxd starts again from it")
            .transient());
        }
        Err(Error::checkpoint(format!(
            "another instance of the pipeline wrote the first checkpoint at {} while this one started",
            self.live
        ))
        .remedy("run one instance per pipeline (standbys need checkpoint.store = \"kafka\"); restart this one to resume from the stored checkpoint")
        .superseded())
    }

    /// Runs `f` on the connection (made first if there is none); a failure drops it.
    fn with<T>(
        &self,
        doing: &str,
        f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T> {
        let mut guard = self.connection.lock().expect("store lock");
        if guard.is_none() {
            let connection = self
                .client
                .get_connection_with_timeout(TIMEOUT)
                .and_then(|c| {
                    c.set_read_timeout(Some(TIMEOUT))?;
                    c.set_write_timeout(Some(TIMEOUT))?;
                    Ok(c)
                })
                .map_err(|e| self.error(doing, &e))?;
            *guard = Some(connection);
        }
        let connection = guard.as_mut().expect("just made");
        f(connection).map_err(|e| {
            *guard = None;
            self.error(doing, &e)
        })
    }

    fn error(&self, doing: &str, e: &redis::RedisError) -> Error {
        let error = Error::checkpoint(format!(
            "Redis at {} failed while {doing} the checkpoint: {e}",
            self.shown
        ));
        if e.code()
            .is_some_and(|c| matches!(c, "NOPERM" | "WRONGPASS" | "NOAUTH"))
        {
            return error.remedy(
                "grant outboxd's user +get +set +del +hget +hset +hkeys +hdel +watch +multi +exec +eval +wait on ~outboxd:checkpoint:*",
            );
        }
        if e.code() == Some("WRONGTYPE") {
            return error.remedy(format!(
                "{} must be a string and {} a hash: move away whatever holds those keys",
                self.live, self.saved
            ));
        }
        error
            .remedy("outboxd retries; check that redis-server is up and redis.url")
            .transient()
    }
}

impl Backend for std::sync::Arc<RedisStore> {
    fn where_live(&self) -> String {
        format!("Redis key {} at {}", self.live, self.shown)
    }

    fn where_saved(&self) -> String {
        format!("Redis hash {} at {}", self.saved, self.shown)
    }

    fn read(&self, slot: &Slot) -> Result<Option<Vec<u8>>> {
        match slot {
            Slot::Live => self.with("reading", |c| c.get(&self.live)),
            Slot::Saved(label) => self.with("reading", |c| c.hget(&self.saved, *label)),
        }
    }

    fn write(&self, slot: &Slot, body: &[u8]) -> Result<()> {
        match slot {
            Slot::Live => {
                self.with("writing", |c| c.set::<_, _, ()>(&self.live, body))?;
                self.expect(Some(body.to_vec()));
                Ok(())
            }
            Slot::Saved(label) => self.with("saving", |c| {
                c.hset::<_, _, _, ()>(&self.saved, *label, body)
            }),
        }
    }

    fn remove(&self, slot: &Slot) -> Result<()> {
        match slot {
            Slot::Live => {
                self.with("removing", |c| c.del::<_, ()>(&self.live))?;
                self.expect(None);
                Ok(())
            }
            Slot::Saved(label) => {
                self.with("removing", |c| c.hdel::<_, _, ()>(&self.saved, *label))
            }
        }
    }

    fn saved_labels(&self) -> Result<Vec<String>> {
        self.with("listing saved copies of", |c| c.hkeys(&self.saved))
    }
}
