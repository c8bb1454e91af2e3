//! Preflight: one PASS/WARN/FAIL line per requirement, each FAIL with the command that fixes it.
//!
//! `outboxd check` prints the report and exits 1 on any FAIL. `outboxd run` performs the same checks at
//! start and refuses to start on a misconfiguration; "cannot reach" results do not block `run`, because
//! the pipeline's own reconnect loop handles servers that are merely not up yet.

use crate::checkpoint::{Access, Store};
use crate::config::{Config, SourceDb};
pub use crate::preflight::{Item, Status};

pub struct Report {
    pub items: Vec<Item>,
}

impl Report {
    /// Any FAIL, counting unreachable servers.
    pub fn failed(&self) -> bool {
        self.items
            .iter()
            .any(|i| matches!(i.status, Status::Fail | Status::Unreachable))
    }

    /// The misconfigurations that stop `run`. Prune's are not among them: a round that meets one
    /// fails (and is tried again every `prune.every`) while forwarding goes on, so `run` logs them
    /// instead ([`Report::advisory`]).
    pub fn blocking(&self) -> Vec<&Item> {
        self.items
            .iter()
            .filter(|i| i.status == Status::Fail && i.subject != "prune")
            .collect()
    }

    /// FAILs that `run` reports and starts anyway.
    pub fn advisory(&self) -> Vec<&Item> {
        self.items
            .iter()
            .filter(|i| i.status == Status::Fail && i.subject == "prune")
            .collect()
    }
}

/// Runs every check for `config`.
pub async fn run(config: &Config) -> Report {
    let mut items = vec![Item::pass("config", "parsed and valid")];
    for unused in config.source.unused_keys() {
        items.push(Item::warn(
            "config",
            unused,
            "remove it, or check source.kind",
        ));
    }
    let checkpoint = match Store::open(config, &config.name, Access::Read) {
        Ok(store) => match store.load().inspect(|_| {
            if let Some(kafka) = store.kafka() {
                items.extend(kafka.durability_items());
            }
        }) {
            Ok(Some(c)) => {
                items.push(Item::pass(
                    "checkpoint",
                    format!("{} at {}", store.describe(), c.position),
                ));
                Some(c)
            }
            Ok(None) => {
                items.push(Item::pass(
                    "checkpoint",
                    format!(
                        "none yet at {} ({})",
                        store.describe(),
                        config.source.first_start()
                    ),
                ));
                None
            }
            Err(e) => {
                items.push(Item::fail(
                    "checkpoint",
                    e.message().to_string(),
                    e.remedy_text().unwrap_or("").to_string(),
                ));
                None
            }
        },
        Err(e) => {
            items.push(Item::fail(
                "checkpoint",
                e.message().to_string(),
                e.remedy_text().unwrap_or("").to_string(),
            ));
            None
        }
    };
    // A snapshot in progress streams from its `then` afterwards: that is what the server must keep.
    let position = checkpoint.as_ref().map(|c| match &c.position {
        crate::source::Position::Snapshot(at) => &at.then,
        other => other,
    });
    let wanted = config.route.columns();
    match &config.source.db {
        SourceDb::Mysql(_) => {
            for url in config.source.urls() {
                let one = config.source.with_url(url);
                items.extend(crate::source::mysql::preflight(&one, position, &wanted).await)
            }
        }
        SourceDb::Postgres(own) => items.extend(
            crate::source::postgres::preflight(&config.source, own, position, &wanted).await,
        ),
    }
    if let Some(prune) = &config.prune {
        items.extend(crate::retention::preflight(prune, &config.source).await);
    }
    let route = config.route.clone();
    let wanted = crate::sink::kafka::Wanted {
        fixed_event_topic: route.fixed_topic().map(str::to_string),
        event_topic: Box::new(move |topic| route.may_name(topic)),
        checkpoint_topic: (config.checkpoint.store == crate::config::StoreKind::Kafka)
            .then(|| config.checkpoint.topic.clone()),
        checkpoint_in_redis: config.checkpoint.store == crate::config::StoreKind::Redis,
    };
    items.extend(config.sink().preflight(wanted).await);
    Report { items }
}
