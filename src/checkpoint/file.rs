//! The file store: `<dir>/<name>.json`, human-readable, written atomically (temp file, fsync,
//! rename, fsync of the directory), guarded by a lock file so two `run`s never share one. Saved
//! copies live in `<dir>/<name>.saved/<label>.json`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::store::{Backend, Slot};
use crate::error::{Error, Result};

/// Random characters in a checkpoint temp file's name (`.NAME.XXXXXX.tmp`).
const TEMP_RANDOM_LEN: usize = 6;

/// The pipeline's checkpoint file, held under a lock for as long as this value lives.
pub struct FileStore {
    name: String,
    dir: PathBuf,
    path: PathBuf,
    _lock: Option<File>,
}

impl FileStore {
    /// Opens the store of pipeline `name` in `dir` and takes its lock (for `run`).
    pub fn open_locked(dir: &Path, name: &str) -> Result<FileStore> {
        let mut store = FileStore::open_unlocked(dir, name)?;
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
    pub fn open_unlocked(dir: &Path, name: &str) -> Result<FileStore> {
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
        Ok(FileStore {
            name: name.to_string(),
            dir: dir.to_path_buf(),
            path: dir.join(format!("{name}.json")),
            _lock: None,
        })
    }

    fn saved_dir(&self) -> PathBuf {
        self.dir.join(format!("{}.saved", self.name))
    }

    fn path_of(&self, slot: &Slot) -> PathBuf {
        match slot {
            Slot::Live => self.path.clone(),
            Slot::Saved(label) => self.saved_dir().join(format!("{label}.json")),
        }
    }
}

impl Backend for FileStore {
    fn where_live(&self) -> String {
        self.path.display().to_string()
    }

    fn where_saved(&self) -> String {
        self.saved_dir().display().to_string()
    }

    fn read(&self, slot: &Slot) -> Result<Option<Vec<u8>>> {
        let path = self.path_of(slot);
        match std::fs::read(&path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::checkpoint(format!(
                "cannot read checkpoint {}: {e}",
                path.display()
            ))
            .remedy("make the file readable by the outboxd user")),
        }
    }

    fn write(&self, slot: &Slot, body: &[u8]) -> Result<()> {
        let path = self.path_of(slot);
        let dir = path.parent().expect("a checkpoint path has a directory");
        if matches!(slot, Slot::Saved(_)) {
            std::fs::create_dir_all(dir).map_err(|e| {
                Error::checkpoint(format!("cannot create {}: {e}", dir.display()))
                    .remedy(format!("make {} writable", self.dir.display()))
            })?;
        }
        write_atomically(dir, &path, &self.name, body)
    }

    fn remove(&self, slot: &Slot) -> Result<()> {
        let path = self.path_of(slot);
        std::fs::remove_file(&path)
            .map_err(|e| Error::checkpoint(format!("cannot remove {}: {e}", path.display())))?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| Error::checkpoint(format!("cannot fsync {}: {e}", self.dir.display())))
    }

    fn saved_labels(&self) -> Result<Vec<String>> {
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
        Ok(entries
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                let label = name.strip_suffix(".json")?;
                (!label.starts_with('.')).then(|| label.to_string())
            })
            .collect())
    }
}

/// Temp file in `dir`, fsync, rename over `path`, fsync `dir`: readers see the old or the new file.
fn write_atomically(dir: &Path, path: &Path, name: &str, body: &[u8]) -> Result<()> {
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
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .rand_bytes(TEMP_RANDOM_LEN)
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| fail("create a temp file for", e))?;
    tmp.write_all(body).map_err(|e| fail("write", e))?;
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

    #[test]
    fn stale_temp_files_are_removed_but_never_another_pipelines() {
        let dir = tempfile::tempdir().unwrap();
        let ours = dir.path().join(".orders.AbC123.tmp");
        // Pipeline `orders.eu` may be writing its checkpoint right now.
        let theirs = dir.path().join(".orders.eu.XyZ789.tmp");
        std::fs::write(&ours, "{}").unwrap();
        std::fs::write(&theirs, "{}").unwrap();
        let _store = FileStore::open_locked(dir.path(), "orders").unwrap();
        assert!(!ours.exists(), "our interrupted write is litter");
        assert!(theirs.exists(), "another pipeline's temp file was removed");
    }

    #[test]
    fn second_lock_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _first = FileStore::open_locked(dir.path(), "orders").unwrap();
        let err = FileStore::open_locked(dir.path(), "orders").err().unwrap();
        assert!(err.to_string().contains("already running"), "{err}");
        assert!(FileStore::open_locked(dir.path(), "other").is_ok());
    }

    #[test]
    fn missing_dir_is_named() {
        let err = FileStore::open_unlocked(Path::new("/nonexistent/outboxd"), "x")
            .err()
            .unwrap();
        assert!(err.to_string().contains("/nonexistent/outboxd"), "{err}");
        assert!(err.remedy_text().unwrap().contains("mkdir"));
    }
}
