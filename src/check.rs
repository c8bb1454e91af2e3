//! Preflight: one PASS/WARN/FAIL line per requirement, each FAIL with the command that fixes it.
//!
//! `outboxd check` prints the report and exits 1 on any FAIL. `outboxd run` performs the same checks at
//! start and refuses to start on a misconfiguration; "cannot reach" results do not block `run`, because
//! the pipeline's own reconnect loop handles servers that are merely not up yet.

use crate::checkpoint::{Access, Store};
use crate::config::{Config, SourceDb, SourceKind};
pub use crate::preflight::{Item, Status};

pub struct Report {
    pub items: Vec<Item>,
    /// Subjects of the hosts of a multi-host `source.url` that FAIL while another host passes:
    /// `run` starts without them (its sessions pass a refusing host over, see
    /// `pipeline::hosts`), so that one bad replica cannot stop the pipeline's restart.
    spared: Vec<String>,
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
            .filter(|i| i.status == Status::Fail && !self.starts_anyway(i))
            .collect()
    }

    /// FAILs that `run` reports and starts anyway.
    pub fn advisory(&self) -> Vec<&Item> {
        self.items
            .iter()
            .filter(|i| i.status == Status::Fail && self.starts_anyway(i))
            .collect()
    }

    fn starts_anyway(&self, item: &Item) -> bool {
        item.subject == "prune" || self.spared.contains(&item.subject)
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
    let mut spared = Vec::new();
    let hosts = source_hosts(config, position, &wanted).await;
    // A Postgres host's FAIL is not a session's refusal of that host (see `spare_hosts`).
    if config.source.kind() == SourceKind::Mysql {
        spared = spare_hosts(&hosts);
    }
    items.extend(hosts.into_iter().flatten());
    items.extend(spared.iter().map(|host| {
        Item::warn(
            host,
            "`run` starts anyway while another host passes; a session that reaches this host is refused by it and moves on",
            "fix this host's FAIL lines; until then the pipeline has one failover host less",
        )
    }));
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
    Report { items, spared }
}

/// The preflight of each host of `source.url`; with several, each host's lines name it.
async fn source_hosts(
    config: &Config,
    position: Option<&crate::source::Position>,
    wanted: &[String],
) -> Vec<Vec<Item>> {
    let urls = config.source.urls();
    let several = urls.len() > 1;
    let mut hosts = Vec::with_capacity(urls.len());
    for url in urls {
        let one = config.source.with_url(url.clone());
        let mut found = match &one.db {
            SourceDb::Mysql(_) => crate::source::mysql::preflight(&one, position, wanted).await,
            SourceDb::Postgres(own) => {
                crate::source::postgres::preflight(&one, own, position, wanted, several).await
            }
        };
        if several {
            let subject = format!("{} {}", one.kind().as_str(), host_of(&url));
            found.iter_mut().for_each(|i| i.subject = subject.clone());
        }
        hosts.push(found);
    }
    hosts
}

/// Of several hosts, those that FAIL while another passes cleanly (no FAIL, and it answered):
/// `run` starts without them, and `check` says so beside their FAIL lines. Only a host whose every
/// FAIL a session also refuses is spared (settings, grants, TLS, the checkpoint's binlog): a
/// missing outbox table or routed column has no such refusal (a session would read the host and
/// lose or dead-letter its rows), so it still stops `run`.
fn spare_hosts(hosts: &[Vec<Item>]) -> Vec<String> {
    let clean = |host: &Vec<Item>| {
        host.iter()
            .all(|i| !matches!(i.status, Status::Fail | Status::Unreachable))
    };
    let fails = |host: &Vec<Item>| host.iter().any(|i| i.status == Status::Fail);
    // The lines of `preflight::routed_columns_item`, which no session checks.
    let sessions_refuse = |host: &Vec<Item>| {
        host.iter()
            .filter(|i| i.status == Status::Fail)
            .all(|i| !i.detail.starts_with("outbox table "))
    };
    if hosts.len() < 2 || !hosts.iter().any(clean) {
        return Vec::new();
    }
    hosts
        .iter()
        .filter(|h| fails(h) && sessions_refuse(h))
        .filter_map(|h| h.first().map(|i| i.subject.clone()))
        .collect()
}

/// `HOST:PORT` of one source URL (no user, password or database).
fn host_of(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(u) => match (u.host_str(), u.port()) {
            (Some(h), Some(p)) => format!("{h}:{p}"),
            (Some(h), None) => h.to_string(),
            _ => crate::source::config::redact_url(url),
        },
        Err(_) => crate::source::config::redact_url(url),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(subject: &str, fail: bool) -> Vec<Item> {
        let mut items = vec![Item::pass(subject, "connected")];
        if fail {
            items.push(Item::fail(subject, "log_slave_updates = OFF", "set it"));
        }
        items
    }

    #[test]
    fn run_starts_without_a_failing_host_only_while_another_host_passes() {
        let one_bad = [host("mysql a:1", true), host("mysql b:2", false)];
        assert_eq!(spare_hosts(&one_bad), vec!["mysql a:1".to_string()]);
        let report = Report {
            items: one_bad.concat(),
            spared: spare_hosts(&one_bad),
        };
        assert!(report.blocking().is_empty());
        assert_eq!(report.advisory().len(), 1);
        assert!(report.failed(), "`check` still fails");
        let all_bad = [host("mysql a:1", true), host("mysql b:2", true)];
        assert!(spare_hosts(&all_bad).is_empty());
        assert!(spare_hosts(&[host("mysql", true)]).is_empty());
        assert_eq!(
            host_of("mysql://cdc:pw@db.example:3307/app"),
            "db.example:3307"
        );
        // A host that did not answer is no proof that the pipeline can run.
        let unanswered = vec![Item::unreachable("mysql b:2", "no answer", "start it")];
        assert!(spare_hosts(&[host("mysql a:1", true), unanswered]).is_empty());
        // A missing outbox table or column is read, not refused, by a session: never spared.
        let mut no_table = host("mysql a:1", false);
        no_table.push(crate::preflight::routed_columns_item(
            "mysql a:1",
            "app.outbox",
            &[],
            &[],
            "mysql",
        ));
        assert!(spare_hosts(&[no_table, host("mysql b:2", false)]).is_empty());
    }
}
