//! Connecting to Redis, classifying what it refuses, and `check`'s lines.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, RedisError};

use super::config::RedisConfig;
use super::OPEN_TIMEOUT;
use crate::error::{Error, Result};
use crate::preflight::Item;
use crate::source::config::redact_url;

/// A multiplexed connection (commands sent in the order they are issued, replies matched in
/// order). It does not reconnect on its own: a broken connection fails what is in flight, and the
/// session publishes again from the checkpoint.
pub(super) async fn connect(config: &RedisConfig) -> Result<MultiplexedConnection> {
    let shown = redact_url(&config.url);
    let options = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(OPEN_TIMEOUT))
        .set_response_timeout(None);
    client(config)?
        .get_multiplexed_async_connection_with_config(&options)
        .await
        .map_err(|e| connect_error(&shown, &e))
}

/// The client for `redis.url` (and `redis.ca_file`); no connection yet.
pub fn client(config: &RedisConfig) -> Result<Client> {
    let shown = redact_url(&config.url);
    match &config.ca_file {
        Some(path) => {
            let pem = std::fs::read(path).map_err(|e| {
                Error::config(format!("cannot read redis.ca_file {}: {e}", path.display()))
                    .remedy("point redis.ca_file at a readable PEM file of the CA(s) to trust")
            })?;
            Client::build_with_tls(
                config.url.as_str(),
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                },
            )
        }
        None => Client::open(config.url.as_str()),
    }
    .map_err(|e| {
        Error::config(format!("redis.url {shown}: {e}"))
            .remedy("write url = \"redis://[user:password@]host:6379/0\" (rediss:// for TLS)")
    })
}

fn connect_error(shown: &str, e: &RedisError) -> Error {
    let text = e.to_string();
    let code = e.code().unwrap_or_default();
    if matches!(e.kind(), redis::ErrorKind::AuthenticationFailed)
        || matches!(code, "WRONGPASS" | "NOAUTH" | "NOPERM")
    {
        return Error::sink(format!("Redis at {shown} refused the login: {text}"))
            .remedy("check the user and password in redis.url (or OUTBOXD_REDIS__URL) and the user's ACL (+multi +exec +xadd, and +info +config|get +type for check)");
    }
    let lower = text.to_ascii_lowercase();
    if lower.contains("certificate") || lower.contains("verify failed") {
        return Error::sink(format!("TLS to Redis at {shown} failed: {text}")).remedy(
            "check redis.ca_file and that the server's certificate names the host in redis.url",
        );
    }
    Error::sink(format!("cannot reach Redis at {shown}: {text}"))
        .remedy("outboxd retries; check redis.url and that redis-server is up")
        .transient()
}

/// Codes of refusals the server heals by itself (memory freed, a load finished, a failover done):
/// sent again from the checkpoint. Any other refusal stops outboxd with the server's words.
pub(super) const HEALING: [&str; 7] = [
    "OOM",
    "LOADING",
    "BUSY",
    "TRYAGAIN",
    "READONLY",
    "MASTERDOWN",
    "NOREPLICAS",
];

/// A batch or a command failed as a whole, classified by the server's error codes. A transaction
/// aborted while its commands were queued carries each command's refusal: all of them must heal
/// for a retry. A refused `MULTI` is *not* one of them: the commands after it then ran one by one,
/// and retrying would store them again and again.
pub(super) fn command_error(doing: &str, e: &RedisError) -> Error {
    let text = e.to_string();
    if e.is_timeout() {
        return Error::sink(format!(
            "Redis did not answer within redis.message_timeout_ms while {doing}"
        ))
        .remedy("outboxd sends again from the checkpoint; check the server")
        .transient();
    }
    let codes: Vec<String> = match e.clone().into_server_errors() {
        Some(errors) => errors.iter().map(|(_, e)| e.code().to_string()).collect(),
        None => {
            return Error::sink(format!("Redis failed while {doing}: {text}"))
                .remedy("outboxd reconnects and sends again from the checkpoint")
                .transient()
        }
    };
    if !codes.is_empty() && codes.iter().all(|c| HEALING.contains(&c.as_str())) {
        let remedy = if codes.iter().any(|c| c == "OOM") {
            "Redis is at maxmemory: outboxd sends the batch again from the checkpoint, in order, once it has room; raise maxmemory or let consumers trim the streams"
        } else if codes.iter().any(|c| c == "READONLY") {
            "Redis is a replica: point redis.url at the primary; outboxd retries (after a failover the name may move)"
        } else {
            "outboxd sends the batch again from the checkpoint, in order; check the server (INFO)"
        };
        return Error::sink(format!("Redis refused a batch while {doing}: {text}"))
            .remedy(remedy)
            .transient();
    }
    if codes.iter().any(|c| c == "NOPERM") {
        return Error::sink(format!("Redis refused outboxd's user while {doing}: {text}"))
            .remedy("grant the user +multi +exec +xadd (+wait with redis.wait_replicas) on the stream keys (~outbox.*), then restart outboxd (nothing was skipped)");
    }
    Error::sink(format!("Redis refused a batch while {doing}: {text}")).remedy(
        "fix what the server names (MULTI/EXEC must be allowed; Redis Cluster is not supported), then restart outboxd (nothing was skipped)",
    )
}

/// `check`'s lines for the Redis sink: reachable with these credentials, a primary, durable
/// (AOF with `appendfsync always`, else WARN: an acknowledged entry can be lost in a crash),
/// never evicting keys, and the streams it can know before running (a fixed route topic, the
/// dead-letter stream) are streams or absent.
pub async fn preflight(
    config: &RedisConfig,
    fixed_topic: Option<&str>,
    checkpoint_in_redis: bool,
) -> Vec<Item> {
    let shown = redact_url(&config.url);
    let mut connection = match tokio::time::timeout(OPEN_TIMEOUT, connect(config)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            let remedy = e.remedy_text().unwrap_or("see the message").to_string();
            return vec![if e.is_transient() {
                Item::unreachable("redis", e.message(), remedy)
            } else {
                Item::fail("redis", e.message(), remedy)
            }];
        }
        Err(_) => {
            return vec![Item::unreachable(
                "redis",
                format!("Redis at {shown} did not answer within {OPEN_TIMEOUT:?}"),
                "check that redis-server is up",
            )]
        }
    };
    let info: String = match query(
        &mut connection,
        redis::cmd("INFO").arg("server").arg("replication"),
    )
    .await
    {
        Ok(info) => info,
        Err(e) => {
            return vec![Item::fail(
                "redis",
                format!("INFO failed: {e}"),
                "grant the user +info",
            )]
        }
    };
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(|v| v.trim().to_string())
    };
    let mut items = vec![Item::pass(
        "redis",
        format!(
            "connected to {shown} (redis {}, role {})",
            field("redis_version").unwrap_or_default(),
            field("role").unwrap_or_default()
        ),
    )];
    if field("role").as_deref() == Some("slave") {
        items.push(Item::fail(
            "redis role",
            "this server is a replica: writes are refused",
            "point redis.url at the primary",
        ));
    }
    if field("redis_mode").as_deref() == Some("cluster") {
        items.push(Item::fail(
            "redis mode",
            "Redis Cluster is not supported yet (a batch's keys would need one hash slot)",
            "point redis.url at a standalone primary",
        ));
    }
    items.push(transaction_item(&mut connection).await);
    items.push(durability_item(&mut connection).await);
    items.push(eviction_item(&mut connection, checkpoint_in_redis).await);
    if config.maxlen.is_some() {
        items.push(Item::warn(
            "redis maxlen",
            "redis.maxlen trims each stream whether or not its entries were read: entries consumers have not read yet can be lost",
            "remove redis.maxlen and let consumers trim (XTRIM MINID, XDEL) unless losing unread entries is acceptable",
        ));
    }
    let streams = fixed_topic.map(|t| ("redis stream", t)).into_iter().chain(
        config
            .dead_letter_topic
            .as_deref()
            .map(|t| ("redis dead-letter stream", t)),
    );
    for (what, key) in streams {
        items.push(match query::<String>(&mut connection, redis::cmd("TYPE").arg(key)).await {
            Ok(t) if t == "stream" => Item::pass(what, format!("{key:?} is a stream")),
            Ok(t) if t == "none" => Item::pass(what, format!("{key:?} does not exist yet (the first entry creates it)")),
            Ok(t) => Item::fail(what, format!("{key:?} holds a {t}, not a stream: its rows would be dead-lettered or stop outboxd"), "route to another key, or remove the key"),
            Err(e) => Item::unreachable(what, format!("TYPE {key:?} failed: {e}"), "grant the user +type"),
        });
    }
    items
}

async fn query<T: redis::FromRedisValue>(
    connection: &mut MultiplexedConnection,
    cmd: &mut redis::Cmd,
) -> redis::RedisResult<T> {
    match tokio::time::timeout(OPEN_TIMEOUT, cmd.query_async(connection)).await {
        Ok(result) => result,
        Err(_) => Err(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "no answer",
        ))),
    }
}

async fn config_get(connection: &mut MultiplexedConnection, name: &str) -> Option<String> {
    let pairs: Vec<String> = query(connection, redis::cmd("CONFIG").arg("GET").arg(name))
        .await
        .ok()?;
    pairs.get(1).cloned()
}

/// `MULTI`/`EXEC` work for this user: every batch is one.
async fn transaction_item(connection: &mut MultiplexedConnection) -> Item {
    match tokio::time::timeout(OPEN_TIMEOUT, probe_multi(connection)).await {
        Ok(Ok(())) => Item::pass("redis transactions", "MULTI/EXEC allowed"),
        Ok(Err(e)) => Item::fail(
            "redis transactions",
            format!("MULTI/EXEC refused: {e}"),
            "grant the user +multi +exec (every batch is one transaction)",
        ),
        Err(_) => Item::unreachable(
            "redis transactions",
            "no answer to MULTI",
            "check the server",
        ),
    }
}

/// `MULTI` then `DISCARD`, as plain commands. Asked before any batch: a refused `MULTI` inside a
/// batch would let its commands run one by one (and redis-rs's transaction reply parsing panics
/// its connection task on it), so a retry would store them again.
pub(super) async fn probe_multi(connection: &mut MultiplexedConnection) -> redis::RedisResult<()> {
    redis::cmd("MULTI").query_async::<()>(connection).await?;
    redis::cmd("DISCARD").query_async::<()>(connection).await
}

async fn durability_item(connection: &mut MultiplexedConnection) -> Item {
    let appendonly = config_get(connection, "appendonly").await;
    let fsync = config_get(connection, "appendfsync").await;
    match (appendonly.as_deref(), fsync.as_deref()) {
        (Some("yes"), Some("always")) => Item::pass(
            "redis durability",
            "appendonly yes, appendfsync always: an acknowledged entry survives a crash of this server (not a failover to a replica that lacks it: redis.wait_replicas)",
        ),
        (Some("yes"), Some(fsync)) => Item::warn(
            "redis durability",
            format!("appendonly yes, appendfsync {fsync}: a crash of Redis (or its host) can lose up to a second of acknowledged entries"),
            "CONFIG SET appendfsync always (and in redis.conf) if no acknowledged row may be lost",
        ),
        (Some(_), _) => Item::warn(
            "redis durability",
            "appendonly no: a crash of Redis loses every entry since the last snapshot, though outboxd counted them delivered",
            "CONFIG SET appendonly yes; CONFIG SET appendfsync always (and in redis.conf)",
        ),
        (None, _) => Item::warn(
            "redis durability",
            "cannot read appendonly (CONFIG GET is not allowed, or renamed)",
            "make sure the server runs with appendonly yes and appendfsync always",
        ),
    }
}

/// `checkpoint_in_redis`: an evicting policy is a FAIL, since losing the checkpoint key would make
/// the next start begin at the source's end.
async fn eviction_item(connection: &mut MultiplexedConnection, checkpoint_in_redis: bool) -> Item {
    match config_get(connection, "maxmemory-policy").await.as_deref() {
        Some(policy @ ("noeviction" | "volatile-lru" | "volatile-lfu" | "volatile-random" | "volatile-ttl")) => Item::pass(
            "redis eviction",
            format!("maxmemory-policy {policy}: streams (no TTL) are never evicted; a full server refuses writes and outboxd waits"),
        ),
        Some(policy) if checkpoint_in_redis => Item::fail(
            "redis eviction",
            format!("maxmemory-policy {policy}: a full server may evict the checkpoint key (checkpoint.store = \"redis\"), and the next start would begin at the source's end"),
            "CONFIG SET maxmemory-policy noeviction (and in redis.conf)",
        ),
        Some(policy) => Item::warn(
            "redis eviction",
            format!("maxmemory-policy {policy}: a full server may evict whole streams"),
            "CONFIG SET maxmemory-policy noeviction (and in redis.conf)",
        ),
        None => Item::warn(
            "redis eviction",
            "cannot read maxmemory-policy (CONFIG GET is not allowed, or renamed)",
            "make sure the server runs with maxmemory-policy noeviction",
        ),
    }
}

/// How long `WAIT` may wait: the batch's timeout.
pub(super) fn wait_millis(timeout: Duration) -> u64 {
    timeout.as_millis().min(u64::MAX as u128) as u64
}
