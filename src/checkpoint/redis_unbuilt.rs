//! The Redis checkpoint store of a build without the `redis` feature. It cannot be opened (a
//! config with `checkpoint.store = "redis"` needs the Redis sink, which such a build refuses at
//! load, naming the feature), so it has no values and its methods are never called.

use super::store::{Backend, Slot};
use crate::config::Config;
use crate::error::{Error, Result};

pub enum RedisStore {}

impl RedisStore {
    pub fn open(_: &Config, _: &str) -> Result<RedisStore> {
        Err(Error::config(
            "checkpoint.store = \"redis\" needs the `redis` feature, which this outboxd was built without",
        )
        .remedy("build it with the feature: cargo build --release --features redis (the default features have it)"))
    }

    pub fn key(&self) -> &str {
        match *self {}
    }

    pub fn expected(&self) -> Option<Vec<u8>> {
        match *self {}
    }

    pub fn committing(&self, _: Vec<u8>) -> Option<Vec<u8>> {
        match *self {}
    }

    pub fn committed(&self) {
        match *self {}
    }

    pub fn resume(&self) -> Result<Option<Vec<u8>>> {
        match *self {}
    }

    pub fn write_first(&self, _: &[u8]) -> Result<()> {
        match *self {}
    }
}

impl Backend for std::sync::Arc<RedisStore> {
    fn where_live(&self) -> String {
        match **self {}
    }

    fn where_saved(&self) -> String {
        match **self {}
    }

    fn read(&self, _: &Slot) -> Result<Option<Vec<u8>>> {
        match **self {}
    }

    fn write(&self, _: &Slot, _: &[u8]) -> Result<()> {
        match **self {}
    }

    fn remove(&self, _: &Slot) -> Result<()> {
        match **self {}
    }

    fn saved_labels(&self) -> Result<Vec<String>> {
        match **self {}
    }
}
