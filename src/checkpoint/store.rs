//! The checkpoint file: `<dir>/<name>.json`, human-readable, written atomically.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::source::{Position, SourceIdentity};

const VERSION: u32 = 1;
/// Random characters in a checkpoint temp file's name (`.NAME.XXXXXX.tmp`).
const TEMP_RANDOM_LEN: usize = 6;

/// The file's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    pub version: u32,
    pub name: String,
    pub source: SourceIdentity,
    pub position: Position,
    pub updated_at: String,
}

/// The pipeline's checkpoint file, held under a lock for as long as this value lives.
pub struct Store {
    name: String,
    dir: PathBuf,
    path: PathBuf,
    _lock: Option<File>,
    /// What this process last wrote, so an unchanged position is not rewritten on every heartbeat.
    last_written: std::sync::Mutex<Option<(SourceIdentity, Position)>>,
}

impl Store {
    /// Opens the store of pipeline `name` in `dir` and takes its lock (for `run`).
    pub fn open_locked(dir: &Path, name: &str) -> Result<Store> {
        let mut store = Store::open_unlocked(dir, name)?;
        let lock_path = dir.join(format!("{name}.lock"));
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| {
                Error::checkpoint(format!(
                    "cannot create lock file {}: {e}",
                    lock_path.display()
                ))
                .remedy(format!(
                    "make {} writable by the outboxd user",
                    dir.display()
                ))
            })?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(Error::checkpoint(format!(
                    "another outboxd holds {} (pipeline {name:?} is already running)",
                    lock_path.display()
                ))
                .remedy("stop the other `outboxd run`, or give this pipeline another name"))
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(Error::checkpoint(format!(
                    "cannot lock {}: {e}",
                    lock_path.display()
                )))
            }
        }
        store._lock = Some(lock);
        store.remove_stale_temp_files();
        Ok(store)
    }

    /// Temp files of a write a crash interrupted (before its rename): the checkpoint itself is whole,
    /// these are litter. Only the lock holder may remove them.
    fn remove_stale_temp_files(&self) {
        let prefix = format!(".{}.", self.name);
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                // `.NAME.XXXXXX.tmp` exactly: pipeline `orders` must not take `orders.eu`'s
                // `.orders.eu.XXXXXX.tmp` for its own.
                let ours = name
                    .strip_prefix(&prefix)
                    .and_then(|rest| rest.strip_suffix(".tmp"))
                    .is_some_and(|random| {
                        random.len() == TEMP_RANDOM_LEN
                            && random.chars().all(|c| c.is_ascii_alphanumeric())
                    });
                if ours {
                    tracing::info!(file = %name, "removing the temp file of an interrupted checkpoint write");
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
    }

    /// Opens the store for reading (`checkpoint show`), without the lock.
    pub fn open_unlocked(dir: &Path, name: &str) -> Result<Store> {
        if !dir.is_dir() {
            return Err(Error::checkpoint(format!(
                "checkpoint directory {} does not exist",
                dir.display()
            ))
            .remedy(format!(
                "create it (mkdir -p {}) or set checkpoint.dir to an existing, persistent directory",
                dir.display()
            )));
        }
        Ok(Store {
            name: name.to_string(),
            dir: dir.to_path_buf(),
            path: dir.join(format!("{name}.json")),
            _lock: None,
            last_written: std::sync::Mutex::new(None),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored checkpoint; `None` if there is no file yet. A damaged file is an error, never `None`.
    pub fn load(&self) -> Result<Option<Checkpoint>> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(Error::checkpoint(format!(
                    "cannot read checkpoint {}: {e}",
                    self.path.display()
                ))
                .remedy("make the file readable by the outboxd user"))
            }
        };
        let damaged = |why: String| {
            Error::checkpoint(format!(
                "checkpoint {} is damaged: {why}; outboxd will not guess a position",
                self.path.display()
            ))
            .remedy(format!(
                "restore a saved copy from {}, or write a known position with `outboxd checkpoint set POSITION`",
                self.dir.join(format!("{}.saved", self.name)).display()
            ))
        };
        let checkpoint: Checkpoint =
            serde_json::from_str(&text).map_err(|e| damaged(e.to_string()))?;
        if checkpoint.version != VERSION {
            return Err(damaged(format!("unknown version {}", checkpoint.version)));
        }
        if checkpoint.name != self.name {
            return Err(Error::checkpoint(format!(
                "checkpoint {} belongs to pipeline {:?}, not {:?}",
                self.path.display(),
                checkpoint.name,
                self.name
            ))
            .remedy("use the matching `name` in the config, or move the file away"));
        }
        Ok(Some(checkpoint))
    }

    /// Writes atomically: temp file in the same directory, fsync, rename over, fsync the directory.
    pub fn write(&self, source: &SourceIdentity, position: &Position) -> Result<Checkpoint> {
        let checkpoint = Checkpoint {
            version: VERSION,
            name: self.name.clone(),
            source: source.clone(),
            position: position.clone(),
            updated_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        };
        write_atomically(&self.dir, &self.path, &checkpoint)?;
        *self.last_written.lock().expect("store lock") = Some((source.clone(), position.clone()));
        Ok(checkpoint)
    }

    /// Writes `position` unless it is what this process wrote last; `true` if it wrote.
    pub fn advance(&self, source: &SourceIdentity, position: &Position) -> Result<bool> {
        let unchanged = self
            .last_written
            .lock()
            .expect("store lock")
            .as_ref()
            .is_some_and(|(s, p)| s == source && p == position);
        if unchanged {
            return Ok(false);
        }
        self.write(source, position)?;
        Ok(true)
    }

    /// Where saved copies live: `<dir>/<name>.saved/`.
    pub fn saved_dir(&self) -> PathBuf {
        self.dir.join(format!("{}.saved", self.name))
    }

    fn saved_path(&self, label: &str) -> Result<PathBuf> {
        let valid = !label.is_empty()
            && !label.starts_with('.')
            && label
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !valid {
            return Err(
                Error::config(format!("{label:?} cannot name a saved checkpoint"))
                    .remedy("use letters, digits, '-', '_' or '.'"),
            );
        }
        Ok(self.saved_dir().join(format!("{label}.json")))
    }

    /// Copies the current checkpoint to `<name>.saved/<label>.json`.
    pub fn save(&self, label: &str) -> Result<(PathBuf, Checkpoint)> {
        let path = self.saved_path(label)?;
        let checkpoint = self.load()?.ok_or_else(|| {
            Error::checkpoint(format!(
                "there is no checkpoint at {} to save",
                self.path.display()
            ))
            .remedy("run the pipeline first, or write one with `outboxd checkpoint set`")
        })?;
        let dir = self.saved_dir();
        std::fs::create_dir_all(&dir).map_err(|e| {
            Error::checkpoint(format!("cannot create {}: {e}", dir.display()))
                .remedy(format!("make {} writable", self.dir.display()))
        })?;
        write_atomically(&dir, &path, &checkpoint)?;
        Ok((path, checkpoint))
    }

    /// A saved checkpoint by label.
    pub fn load_saved(&self, label: &str) -> Result<Checkpoint> {
        let path = self.saved_path(label)?;
        let text = std::fs::read_to_string(&path).map_err(|e| {
            Error::checkpoint(format!(
                "no saved checkpoint {label:?} ({}: {e})",
                path.display()
            ))
            .remedy("see `outboxd checkpoint list` for the saved labels")
        })?;
        serde_json::from_str(&text).map_err(|e| {
            Error::checkpoint(format!(
                "saved checkpoint {} is damaged: {e}",
                path.display()
            ))
            .remedy("pick another label, or a position")
        })
    }

    /// Saved checkpoints, by label.
    pub fn list_saved(&self) -> Result<Vec<(String, Checkpoint)>> {
        let dir = self.saved_dir();
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => {
                return Err(Error::checkpoint(format!(
                    "cannot list {}: {e}",
                    dir.display()
                )))
            }
        };
        let mut saved = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(label) = name.strip_suffix(".json") {
                if !label.starts_with('.') {
                    saved.push((label.to_string(), self.load_saved(label)?));
                }
            }
        }
        saved.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(saved)
    }

    /// Removes the live checkpoint after saving it as `before-reset-<time>`; returns that label.
    pub fn reset(&self) -> Result<Option<String>> {
        if self.load()?.is_none() {
            return Ok(None);
        }
        let label = format!(
            "before-reset-{}",
            chrono::Utc::now().format("%Y%m%dT%H%M%SZ")
        );
        self.save(&label)?;
        std::fs::remove_file(&self.path).map_err(|e| {
            Error::checkpoint(format!("cannot remove {}: {e}", self.path.display()))
        })?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| Error::checkpoint(format!("cannot fsync {}: {e}", self.dir.display())))?;
        Ok(Some(label))
    }
}

/// Temp file in `dir`, fsync, rename over `path`, fsync `dir`: readers see the old or the new file.
fn write_atomically(dir: &Path, path: &Path, checkpoint: &Checkpoint) -> Result<()> {
    let fail = |what: &str, e: std::io::Error| {
        Error::checkpoint(format!(
            "cannot {what} checkpoint {}: {e}; the previous checkpoint is intact",
            path.display()
        ))
        .remedy(format!(
            "free space / fix permissions in {}; outboxd resumes from the last good checkpoint",
            dir.display()
        ))
    };
    let mut body = serde_json::to_vec_pretty(checkpoint).expect("checkpoint serializes");
    body.push(b'\n');
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{}.", checkpoint.name))
        .rand_bytes(TEMP_RANDOM_LEN)
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| fail("create a temp file for", e))?;
    tmp.write_all(&body).map_err(|e| fail("write", e))?;
    tmp.as_file().sync_all().map_err(|e| fail("fsync", e))?;
    crate::fault::crash_point(crate::fault::DURING_CHECKPOINT_RENAME);
    tmp.persist(path)
        .map_err(|e| fail("rename into place", e.error))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| fail("fsync the directory of", e))?;
    Ok(())
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
        }
    }

    #[test]
    fn write_then_load_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_locked(dir.path(), "orders").unwrap();
        assert!(store.load().unwrap().is_none());
        let pos: Position =
            serde_json::from_value(serde_json::json!({"file": "b.000001", "pos": 77})).unwrap();
        store.write(&identity(), &pos).unwrap();
        let back = store.load().unwrap().unwrap();
        assert_eq!(back.position, pos);
        assert_eq!(back.source, identity());
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn stale_temp_files_are_removed_but_never_another_pipelines() {
        let dir = tempfile::tempdir().unwrap();
        let ours = dir.path().join(".orders.AbC123.tmp");
        // Pipeline `orders.eu` may be writing its checkpoint right now.
        let theirs = dir.path().join(".orders.eu.XyZ789.tmp");
        std::fs::write(&ours, "{}").unwrap();
        std::fs::write(&theirs, "{}").unwrap();
        let _store = Store::open_locked(dir.path(), "orders").unwrap();
        assert!(!ours.exists(), "our interrupted write is litter");
        assert!(theirs.exists(), "another pipeline's temp file was removed");
    }

    #[test]
    fn second_lock_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _first = Store::open_locked(dir.path(), "orders").unwrap();
        let err = Store::open_locked(dir.path(), "orders").err().unwrap();
        assert!(err.to_string().contains("already running"), "{err}");
        assert!(Store::open_locked(dir.path(), "other").is_ok());
    }

    #[test]
    fn damaged_file_is_an_error_with_a_remedy() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_unlocked(dir.path(), "orders").unwrap();
        std::fs::write(store.path(), "{\"version\":1,\"na").unwrap();
        let err = store.load().unwrap_err();
        assert!(err.to_string().contains("orders.json"), "{err}");
        assert!(err.remedy_text().unwrap().contains("checkpoint set"));
    }

    #[test]
    fn save_list_load_and_reset() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_locked(dir.path(), "orders").unwrap();
        assert!(store.save("x").is_err(), "nothing to save yet");
        let pos: Position =
            serde_json::from_value(serde_json::json!({"file": "b.000001", "pos": 77})).unwrap();
        store.write(&identity(), &pos).unwrap();
        store.save("before-deploy").unwrap();
        assert!(store.save("../evil").is_err());
        let saved = store.list_saved().unwrap();
        assert_eq!(saved.len(), 1);
        assert_eq!(saved[0].0, "before-deploy");
        assert_eq!(store.load_saved("before-deploy").unwrap().position, pos);
        let label = store.reset().unwrap().unwrap();
        assert!(store.load().unwrap().is_none());
        assert_eq!(
            store.load_saved(&label).unwrap().position,
            pos,
            "reset keeps a copy"
        );
        assert_eq!(store.reset().unwrap(), None);
    }

    #[test]
    fn missing_dir_is_named() {
        let err = Store::open_unlocked(Path::new("/nonexistent/outboxd"), "x")
            .err()
            .unwrap();
        assert!(err.to_string().contains("/nonexistent/outboxd"), "{err}");
        assert!(err.remedy_text().unwrap().contains("mkdir"));
    }
}
