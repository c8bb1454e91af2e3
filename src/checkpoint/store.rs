//! The checkpoint file: `<dir>/<name>.json`, human-readable, written atomically.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::source::{Position, SourceIdentity};

const VERSION: u32 = 1;

/// The file's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    pub version: u32,
    pub name: String,
    pub source: SourceIdentity,
    pub position: serde_json::Value,
    pub updated_at: String,
}

impl Checkpoint {
    pub fn position(&self) -> Position {
        Position::from_json(self.position.clone())
    }
}

/// The pipeline's checkpoint file, held under a lock for as long as this value lives.
pub struct Store {
    name: String,
    dir: PathBuf,
    path: PathBuf,
    _lock: Option<File>,
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
        Ok(store)
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
            position: position.json().clone(),
            updated_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        };
        let fail = |what: &str, e: std::io::Error| {
            Error::checkpoint(format!(
                "cannot {what} checkpoint {}: {e}; the previous checkpoint is intact",
                self.path.display()
            ))
            .remedy(format!(
                "free space / fix permissions in {}; outboxd resumes from the last good checkpoint",
                self.dir.display()
            ))
        };
        let mut body = serde_json::to_vec_pretty(&checkpoint).expect("checkpoint serializes");
        body.push(b'\n');
        let mut tmp = tempfile::Builder::new()
            .prefix(&format!(".{}.", self.name))
            .suffix(".tmp")
            .tempfile_in(&self.dir)
            .map_err(|e| fail("create a temp file for", e))?;
        tmp.write_all(&body).map_err(|e| fail("write", e))?;
        tmp.as_file().sync_all().map_err(|e| fail("fsync", e))?;
        tmp.persist(&self.path)
            .map_err(|e| fail("rename into place", e.error))?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| fail("fsync the directory of", e))?;
        Ok(checkpoint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SourceKind;

    fn identity() -> SourceIdentity {
        SourceIdentity {
            kind: SourceKind::Mysql,
            server_id: Some(1),
            server_uuid: None,
        }
    }

    #[test]
    fn write_then_load_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_locked(dir.path(), "orders").unwrap();
        assert!(store.load().unwrap().is_none());
        let pos = Position::from_json(serde_json::json!({"file": "b.000001", "pos": 77}));
        store.write(&identity(), &pos).unwrap();
        let back = store.load().unwrap().unwrap();
        assert_eq!(back.position(), pos);
        assert_eq!(back.source, identity());
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
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
    fn missing_dir_is_named() {
        let err = Store::open_unlocked(Path::new("/nonexistent/outboxd"), "x")
            .err()
            .unwrap();
        assert!(err.to_string().contains("/nonexistent/outboxd"), "{err}");
        assert!(err.remedy_text().unwrap().contains("mkdir"));
    }
}
