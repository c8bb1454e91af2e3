//! The checkpoint store: one JSON document per pipeline, and saved copies of it by label.
//!
//! What a checkpoint *means* is decided here, once: its format, its version, whose it is, what a
//! damaged one does (an error naming the fix, never a guessed position), and how saves, resets and
//! the "write only what changed" rule work. *Where* it lives is a [`Backend`]: a file
//! ([`super::file`]), a record in a compacted Kafka topic ([`super::kafka`]) or a Redis key
//! ([`super::redis`]). A new place is one module implementing `Backend` and one arm in
//! [`Store::open`].

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::file::FileStore;
use super::kafka::KafkaStore;
use super::redis::RedisStore;
use crate::config::{Config, StoreKind};
use crate::error::{Error, Result};
use crate::sink::{CommitMark, Transactional};
use crate::source::{Position, SourceIdentity};

const VERSION: u32 = 1;

/// The stored document (the file's content, or the Kafka record's value).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    pub version: u32,
    pub name: String,
    pub source: SourceIdentity,
    pub position: Position,
    pub updated_at: String,
}

/// Which document of a pipeline.
pub enum Slot<'a> {
    /// The live checkpoint `run` resumes from.
    Live,
    /// A copy saved under a label (`checkpoint save`, and before every set/reset/import).
    Saved(&'a str),
}

/// Where checkpoints live.
pub trait Backend: Send + Sync {
    /// The live checkpoint's place, for messages (`checkpoints/orders.json`).
    fn where_live(&self) -> String;
    /// Where saved copies go, for messages.
    fn where_saved(&self) -> String;
    /// The document's bytes; `None` when there is none.
    fn read(&self, slot: &Slot) -> Result<Option<Vec<u8>>>;
    /// Replaces the document; durable when this returns.
    fn write(&self, slot: &Slot, body: &[u8]) -> Result<()>;
    fn remove(&self, slot: &Slot) -> Result<()>;
    fn saved_labels(&self) -> Result<Vec<String>>;
}

/// How a command uses the store.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `checkpoint show/list/save`, `check`, `replay --from LABEL`: reads, and writes saved copies.
    Read,
    /// `checkpoint set/reset/import-debezium`: replaces the live checkpoint, so no instance of the
    /// pipeline may be running (the file's lock; for Kafka, no member in the pipeline's group).
    Exclusive,
    /// `run`: the file's lock; for Kafka, live writes once [`Store::take_over`] made this instance
    /// the pipeline's only writer.
    Run,
}

/// The checkpoint store of one pipeline.
pub struct Store {
    name: String,
    backend: Box<dyn Backend>,
    kafka: Option<Arc<KafkaStore>>,
    redis: Option<Arc<RedisStore>>,
    /// What this process last wrote, so an unchanged position is not rewritten on every heartbeat.
    last_written: Mutex<Option<(SourceIdentity, Position)>>,
    /// A first start's position this process chose and has not written yet (the write failed):
    /// the next session resumes from it, not from the source's end again, which would skip the
    /// rows committed in between. Any write clears it.
    unwritten_first: Mutex<Option<(SourceIdentity, Position)>>,
}

impl Store {
    /// The configured store of pipeline `name` (`config.name`, or a derived name such as
    /// `NAME.snapshot`).
    pub fn open(config: &Config, name: &str, access: Access) -> Result<Store> {
        match config.checkpoint.store {
            StoreKind::File => {
                let dir = &config.checkpoint.dir;
                let file = match access {
                    Access::Read => FileStore::open_unlocked(dir, name)?,
                    Access::Exclusive | Access::Run => FileStore::open_locked(dir, name)?,
                };
                Ok(Store::with(name, Box::new(file), None))
            }
            StoreKind::Kafka => {
                let kafka = Arc::new(KafkaStore::connect(config, name, access != Access::Read)?);
                if access == Access::Exclusive {
                    kafka.ensure_no_leader()?;
                    kafka.take_over()?;
                    kafka.hold_for_command();
                    // Also when exactly_once is off now: a leader that ran with it may be frozen
                    // with a transaction open. Without it, a refusal (no grant) only warns.
                    match kafka.fence_records() {
                        Err(e) if !config.kafka().is_some_and(|k| k.exactly_once) => {
                            tracing::warn!(
                                error = %e,
                                "could not fence the pipeline's record producer (only matters if it ran with kafka.exactly_once)"
                            )
                        }
                        other => other?,
                    }
                }
                Ok(Store::with(
                    name,
                    Box::new(kafka.clone()),
                    Some(kafka.clone()),
                ))
            }
            // No lock and no lead: every commit compares the key it replaces (see `redis`).
            StoreKind::Redis => {
                let redis = Arc::new(RedisStore::open(config, name)?);
                let mut store = Store::with(name, Box::new(redis.clone()), None);
                store.redis = Some(redis);
                Ok(store)
            }
        }
    }

    /// A file store in `dir`, locked (replays keep their progress in a scratch directory).
    pub fn file_locked(dir: &std::path::Path, name: &str) -> Result<Store> {
        Ok(Store::with(
            name,
            Box::new(FileStore::open_locked(dir, name)?),
            None,
        ))
    }

    fn with(name: &str, backend: Box<dyn Backend>, kafka: Option<Arc<KafkaStore>>) -> Store {
        Store {
            name: name.to_string(),
            backend,
            kafka,
            redis: None,
            last_written: Mutex::new(None),
            unwritten_first: Mutex::new(None),
        }
    }

    /// The Kafka store, when checkpoints live in Kafka (for the pipeline's lead).
    pub fn kafka(&self) -> Option<&Arc<KafkaStore>> {
        self.kafka.as_ref()
    }

    /// How a run of `config`'s pipeline commits records and checkpoint together, if it does:
    /// `kafka.exactly_once` with the checkpoint in Kafka, or the checkpoint in Redis.
    pub fn transactional(&self, config: &Config) -> Option<Transactional> {
        if let Some(redis) = &self.redis {
            return Some(Transactional::Redis(redis.key().to_string()));
        }
        match &self.kafka {
            Some(kafka) if config.kafka().is_some_and(|k| k.exactly_once) => {
                Some(Transactional::Kafka(kafka.records_transactional_id()))
            }
            _ => None,
        }
    }

    /// Where the live checkpoint is, for messages.
    pub fn describe(&self) -> String {
        self.backend.where_live()
    }

    /// How the last read found the live checkpoint, where the store can say (Kafka: the offset,
    /// and whether its index named it).
    pub fn found(&self) -> Option<String> {
        self.kafka.as_ref().and_then(|k| k.found())
    }

    /// Where saved copies are, for messages.
    pub fn saved_where(&self) -> String {
        self.backend.where_saved()
    }

    /// The stored checkpoint; `None` if there is none yet. A damaged one is an error, never `None`.
    pub fn load(&self) -> Result<Option<Checkpoint>> {
        match self.backend.read(&Slot::Live)? {
            Some(bytes) => self.parse(&bytes).map(Some),
            None => Ok(None),
        }
    }

    /// The live checkpoint's bytes as a checkpoint of this pipeline.
    fn parse(&self, bytes: &[u8]) -> Result<Checkpoint> {
        let damaged = |why: String| {
            Error::checkpoint(format!(
                "checkpoint {} is damaged: {why}; outboxd will not guess a position",
                self.backend.where_live()
            ))
            .remedy(format!(
                "restore a saved copy (`outboxd checkpoint list`, then `outboxd checkpoint set` with its position; saved in {}), or write a known position with `outboxd checkpoint set POSITION`",
                self.backend.where_saved()
            ))
        };
        let checkpoint: Checkpoint =
            serde_json::from_slice(bytes).map_err(|e| damaged(e.to_string()))?;
        if checkpoint.version != VERSION {
            return Err(damaged(format!("unknown version {}", checkpoint.version)));
        }
        if checkpoint.name != self.name {
            return Err(Error::checkpoint(format!(
                "checkpoint {} belongs to pipeline {:?}, not {:?}",
                self.backend.where_live(),
                checkpoint.name,
                self.name
            ))
            .remedy("use the matching `name` in the config, or move the checkpoint away"));
        }
        Ok(checkpoint)
    }

    /// [`Store::load`] for a session that resumes from it: a store whose commits compare what
    /// they replace (Redis) remembers what was read.
    pub fn resume(&self) -> Result<Option<Checkpoint>> {
        let Some(redis) = &self.redis else {
            return self.load();
        };
        // One read: what is compared at the first commit is what the session resumes from.
        match redis.resume()? {
            Some(bytes) => self.parse(&bytes).map(Some),
            None => Ok(None),
        }
    }

    /// Writes the first live checkpoint of a pipeline that has none. The Redis store refuses
    /// when another instance wrote one meanwhile (it has no lock to keep a second one out).
    /// Until one succeeds, [`Store::unwritten_first`] holds the position.
    pub fn write_first(&self, source: &SourceIdentity, position: &Position) -> Result<()> {
        *self.unwritten_first.lock().expect("store lock") =
            Some((source.clone(), position.clone()));
        crate::fault::first_write_fails()?;
        let Some(redis) = &self.redis else {
            return self.write(source, position).map(|_| ());
        };
        redis.write_first(&body(&self.document(source, position)))?;
        self.remember(source, position);
        Ok(())
    }

    /// [`Store::load`] from async code: a Kafka store's read blocks for a network round trip (or
    /// its timeout), a file store's for the disk (a stalled network mount: indefinitely), so on the
    /// multi-threaded runtime it tells the scheduler to move other tasks off this worker meanwhile
    /// (the runtime has one worker: see [`crate::runtime`]).
    pub fn load_from_async(&self) -> Result<Option<Checkpoint>> {
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi_thread {
            tokio::task::block_in_place(|| self.load())
        } else {
            self.load()
        }
    }

    /// Writes the live checkpoint; durable when this returns.
    pub fn write(&self, source: &SourceIdentity, position: &Position) -> Result<Checkpoint> {
        let checkpoint = self.document(source, position);
        self.backend.write(&Slot::Live, &body(&checkpoint))?;
        self.remember(source, position);
        Ok(checkpoint)
    }

    fn document(&self, source: &SourceIdentity, position: &Position) -> Checkpoint {
        Checkpoint {
            version: VERSION,
            name: self.name.clone(),
            source: source.clone(),
            position: position.clone(),
            updated_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        }
    }

    /// Writes `position` unless it is what this process wrote last; `true` if it wrote.
    pub fn advance(&self, source: &SourceIdentity, position: &Position) -> Result<bool> {
        if self.unchanged(source, position) {
            return Ok(false);
        }
        self.write(source, position)?;
        Ok(true)
    }

    /// Whether `position` is what this process wrote last.
    pub fn unchanged(&self, source: &SourceIdentity, position: &Position) -> bool {
        self.last_written
            .lock()
            .expect("store lock")
            .as_ref()
            .is_some_and(|(s, p)| s == source && p == position)
    }

    /// The live checkpoint in the form the sink commits it with the records it covers (Kafka:
    /// a record; Redis: the key's new value and the one it must replace).
    pub fn live_mark(&self, source: &SourceIdentity, position: &Position) -> Result<CommitMark> {
        let body = body(&self.document(source, position));
        if let Some(redis) = &self.redis {
            let uncertain = redis.committing(body.clone());
            return Ok(CommitMark::Key {
                body,
                expected: redis.expected(),
                uncertain,
            });
        }
        let kafka = self.kafka.as_ref().ok_or_else(|| {
            Error::config("kafka.exactly_once needs checkpoint.store = \"kafka\"")
                .remedy("set checkpoint.store = \"kafka\"")
        })?;
        Ok(CommitMark::Record(kafka.live_record(body), kafka.index()))
    }

    /// A transaction holding `position`'s record committed: it is what this process wrote last.
    pub fn mark_written(&self, source: &SourceIdentity, position: &Position) {
        if let Some(redis) = &self.redis {
            redis.committed();
        }
        self.remember(source, position);
    }

    fn remember(&self, source: &SourceIdentity, position: &Position) {
        *self.last_written.lock().expect("store lock") = Some((source.clone(), position.clone()));
        *self.unwritten_first.lock().expect("store lock") = None;
    }

    /// Drops the remembered first start (another writer's checkpoint, or a reset, made it stale).
    pub fn forget_unwritten_first(&self) {
        *self.unwritten_first.lock().expect("store lock") = None;
    }

    /// The first start's checkpoint this process could not write (see [`Store::write_first`]):
    /// where the next session of a pipeline with no stored checkpoint resumes.
    pub fn unwritten_first(&self) -> Option<Checkpoint> {
        let first = self.unwritten_first.lock().expect("store lock").clone();
        first.map(|(source, position)| self.document(&source, &position))
    }

    /// Forgets what this process wrote (a new lead must write its first position even if it
    /// equals what this process wrote before another instance led).
    pub fn forget_last_written(&self) {
        *self.last_written.lock().expect("store lock") = None;
    }

    /// Copies the live checkpoint to `label`; returns where it went.
    pub fn save(&self, label: &str) -> Result<(String, Checkpoint)> {
        check_label(label)?;
        let checkpoint = self.load()?.ok_or_else(|| {
            Error::checkpoint(format!(
                "there is no checkpoint at {} to save",
                self.backend.where_live()
            ))
            .remedy("run the pipeline first, or write one with `outboxd checkpoint set`")
        })?;
        self.backend
            .write(&Slot::Saved(label), &body(&checkpoint))?;
        Ok((
            format!("{} ({label})", self.backend.where_saved()),
            checkpoint,
        ))
    }

    /// A saved checkpoint by label.
    pub fn load_saved(&self, label: &str) -> Result<Checkpoint> {
        check_label(label)?;
        let bytes = self.backend.read(&Slot::Saved(label))?.ok_or_else(|| {
            Error::checkpoint(format!(
                "no saved checkpoint {label:?} in {}",
                self.backend.where_saved()
            ))
            .remedy("see `outboxd checkpoint list` for the saved labels")
        })?;
        serde_json::from_slice(&bytes).map_err(|e| {
            Error::checkpoint(format!(
                "saved checkpoint {label:?} in {} is damaged: {e}",
                self.backend.where_saved()
            ))
            .remedy("pick another label, or a position")
        })
    }

    /// Saved checkpoints, by label.
    pub fn list_saved(&self) -> Result<Vec<(String, Checkpoint)>> {
        let mut saved = Vec::new();
        for label in self.backend.saved_labels()? {
            if check_label(&label).is_ok() {
                let checkpoint = self.load_saved(&label)?;
                saved.push((label, checkpoint));
            }
        }
        saved.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(saved)
    }

    /// Removes the live checkpoint after saving it as `before-reset-<time>`; returns that label
    /// (`Some("")`: the store had lost it, so nothing was saved).
    pub fn reset(&self) -> Result<Option<String>> {
        match self.load() {
            Ok(Some(_)) => {}
            Ok(None) => return Ok(None),
            // The Kafka topic lost the checkpoint its index names: nothing is left to save, and the
            // tombstone (indexed) records that starting anew was the operator's decision.
            Err(_) if self.kafka.as_ref().is_some_and(|k| k.lost()) => {
                self.backend.remove(&Slot::Live)?;
                *self.last_written.lock().expect("store lock") = None;
                return Ok(Some(String::new()));
            }
            Err(e) => return Err(e),
        }
        let label = format!(
            "before-reset-{}",
            chrono::Utc::now().format("%Y%m%dT%H%M%SZ")
        );
        self.save(&label)?;
        self.backend.remove(&Slot::Live)?;
        *self.last_written.lock().expect("store lock") = None;
        Ok(Some(label))
    }
}

fn body(checkpoint: &Checkpoint) -> Vec<u8> {
    let mut body = serde_json::to_vec_pretty(checkpoint).expect("checkpoint serializes");
    body.push(b'\n');
    body
}

fn check_label(label: &str) -> Result<()> {
    let valid = !label.is_empty()
        && !label.starts_with('.')
        && label
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if valid {
        Ok(())
    } else {
        Err(
            Error::config(format!("{label:?} cannot name a saved checkpoint"))
                .remedy("use letters, digits, '-', '_' or '.'"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::config::SourceKind;

    fn identity() -> SourceIdentity {
        SourceIdentity {
            kind: SourceKind::Mysql,
            server_id: Some(1),
            server_uuid: None,
            system_identifier: None,
            slot: None,
            timeline: None,
        }
    }

    fn position() -> Position {
        serde_json::from_value(serde_json::json!({"file": "b.000001", "pos": 77})).unwrap()
    }

    #[test]
    fn write_then_load_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::file_locked(dir.path(), "orders").unwrap();
        assert!(store.load().unwrap().is_none());
        store.write(&identity(), &position()).unwrap();
        let back = store.load().unwrap().unwrap();
        assert_eq!(back.position, position());
        assert_eq!(back.source, identity());
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn damaged_file_is_an_error_with_a_remedy() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::file_locked(dir.path(), "orders").unwrap();
        std::fs::write(dir.path().join("orders.json"), "{\"version\":1,\"na").unwrap();
        let err = store.load().unwrap_err();
        assert!(err.to_string().contains("orders.json"), "{err}");
        assert!(err.remedy_text().unwrap().contains("checkpoint set"));
    }

    #[test]
    fn save_list_load_and_reset() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::file_locked(dir.path(), "orders").unwrap();
        assert!(store.save("x").is_err(), "nothing to save yet");
        store.write(&identity(), &position()).unwrap();
        store.save("before-deploy").unwrap();
        assert!(store.save("../evil").is_err());
        let saved = store.list_saved().unwrap();
        assert_eq!(saved.len(), 1);
        assert_eq!(saved[0].0, "before-deploy");
        assert_eq!(
            store.load_saved("before-deploy").unwrap().position,
            position()
        );
        let label = store.reset().unwrap().unwrap();
        assert!(store.load().unwrap().is_none());
        assert_eq!(
            store.load_saved(&label).unwrap().position,
            position(),
            "reset keeps a copy"
        );
        assert_eq!(store.reset().unwrap(), None);
    }
}
