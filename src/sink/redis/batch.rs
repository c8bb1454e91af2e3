//! The batch task: sends queued entries as `MULTI`/`EXEC` pipelines, one at a time, and hands
//! tickets back in queue order (see the module docs of `redis` for why).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::Value;
use tokio::sync::mpsc;

use super::config::RedisConfig;
use super::connect::{command_error, wait_millis, HEALING};
use super::entry::Fields;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::sink::ack::{Acks, Ticket};
use crate::sink::window::Room;

/// At most this many entries, and about this many bytes, go in one `MULTI`/`EXEC`.
const MAX_BATCH: usize = 1_000;
const MAX_BATCH_BYTES: usize = 8 * 1024 * 1024;

/// An entry waiting for its batch.
pub(super) struct Queued {
    pub ticket: Ticket,
    pub stream: String,
    pub fields: Fields,
    /// A dead letter already (the router's, or this sink's copy): unroutable stops outboxd.
    pub dead_lettered: bool,
    pub enqueued: Instant,
    pub room: Room,
}

pub(super) struct Batcher {
    connection: MultiplexedConnection,
    maxlen: Option<u64>,
    wait_replicas: u32,
    timeout: Duration,
    dead_letter: Option<String>,
    acks: Arc<dyn Acks>,
    metrics: Arc<Metrics>,
}

impl Batcher {
    pub fn new(
        connection: MultiplexedConnection,
        config: &RedisConfig,
        acks: Arc<dyn Acks>,
        metrics: Arc<Metrics>,
    ) -> Batcher {
        Batcher {
            connection,
            maxlen: config.maxlen,
            wait_replicas: config.wait_replicas,
            timeout: config.message_timeout(),
            dead_letter: config.dead_letter_topic.clone(),
            acks,
            metrics,
        }
    }

    pub async fn run(mut self, mut queue: mpsc::UnboundedReceiver<Queued>) {
        while let Some(first) = queue.recv().await {
            let mut bytes = super::entry::size(&first.fields);
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH && bytes < MAX_BATCH_BYTES {
                match queue.try_recv() {
                    Ok(next) => {
                        bytes += super::entry::size(&next.fields);
                        batch.push(next);
                    }
                    Err(_) => break,
                }
            }
            if let Err(e) = self.deliver(batch).await {
                self.metrics.delivery_error();
                self.acks.failed(e);
                return;
            }
        }
    }

    /// One batch: applied, its unroutable entries dead-lettered, replicated if asked, then
    /// settled in order.
    async fn deliver(&mut self, batch: Vec<Queued>) -> Result<()> {
        let commands: Vec<redis::Cmd> = batch
            .iter()
            .map(|q| self.xadd(&q.stream, &q.fields, !q.dead_lettered))
            .collect();
        let replies = self.exec(commands, "adding a batch of entries").await?;
        let mut copies = Vec::new();
        // Where each entry ended up (a dead-lettered one counts under the dead-letter stream).
        let mut landed: Vec<Option<String>> = vec![None; batch.len()];
        for ((q, reply), landed) in batch.iter().zip(&replies).zip(&mut landed) {
            let Value::ServerError(e) = reply else {
                continue;
            };
            *landed = self.dead_letter.clone();
            match e.code() {
                // The row's own fault: its key holds another type.
                "WRONGTYPE" => copies.push(dead_letter_copy(
                    self.dead_letter.as_deref(),
                    &q.stream,
                    &q.fields,
                    q.dead_lettered,
                )?),
                // The server's state, which heals: sent again from the checkpoint.
                _ => return Err(refused_entry(&q.stream, e)),
            }
        }
        if !copies.is_empty() {
            let commands = copies
                .iter()
                .map(|(stream, fields)| self.xadd(stream, fields, false))
                .collect();
            let replies = self.exec(commands, "adding dead letters").await?;
            if let Some(Value::ServerError(e)) =
                replies.iter().find(|r| matches!(r, Value::ServerError(_)))
            {
                return Err(Error::unroutable(format!(
                    "the dead-letter stream {:?} refused a row too: {e:?}",
                    self.dead_letter.as_deref().unwrap_or_default()
                ))
                .remedy("make redis.dead_letter_topic name a stream (or a key that does not exist), then restart outboxd (nothing was skipped)"));
            }
            for _ in &copies {
                self.metrics.dead_letter("unroutable");
            }
        }
        if self.wait_replicas > 0 {
            self.wait().await?;
        }
        let mut forwarded: HashMap<String, u64> = HashMap::new();
        for (q, landed) in batch.into_iter().zip(landed) {
            self.metrics.acknowledged();
            self.metrics.delivered_after(q.enqueued.elapsed());
            *forwarded.entry(landed.unwrap_or(q.stream)).or_default() += 1;
            self.acks.acked(q.ticket);
            drop(q.room);
        }
        for (stream, n) in forwarded {
            self.metrics.forwarded_n(&stream, n);
        }
        Ok(())
    }

    fn xadd(&self, stream: &str, fields: &[(String, Vec<u8>)], trim: bool) -> redis::Cmd {
        xadd(stream, fields, self.maxlen.filter(|_| trim))
    }

    /// `MULTI`, `commands`, `EXEC`: one reply per command (a command that failed inside `EXEC`
    /// is its error); a batch refused as a whole (`EXECABORT`: out of memory while queuing) or
    /// no reply in time is an error.
    async fn exec(&mut self, commands: Vec<redis::Cmd>, doing: &str) -> Result<Vec<Value>> {
        let count = commands.len();
        let mut pipe = redis::pipe();
        pipe.atomic().ignore_errors();
        for cmd in commands {
            pipe.add_command(cmd);
        }
        let replies: Vec<Value> = match tokio::time::timeout(
            self.timeout,
            pipe.query_async(&mut self.connection),
        )
        .await
        {
            Ok(replies) => replies.map_err(|e| command_error(doing, &e))?,
            Err(_) => {
                return Err(Error::sink(format!(
                    "Redis did not answer within redis.message_timeout_ms ({:?}) while {doing}",
                    self.timeout
                ))
                .remedy("outboxd sends again from the checkpoint; check the server")
                .transient())
            }
        };
        if replies.len() != count {
            return Err(Error::sink(format!(
                "Redis answered {} replies to {count} commands while {doing}",
                replies.len()
            ))
            .remedy("outboxd sends again from the checkpoint")
            .transient());
        }
        Ok(replies)
    }

    async fn wait(&mut self) -> Result<()> {
        wait(&mut self.connection, self.wait_replicas, self.timeout).await
    }
}

/// An entry for `stream` refused for a reason of the server's (not its key's type): sent again
/// from the checkpoint when it heals by itself, else outboxd stops with the server's words.
pub(super) fn refused_entry(stream: &str, e: &redis::ServerError) -> Error {
    let error = Error::sink(format!(
        "Redis refused an entry for stream {stream:?}: {e:?}"
    ));
    if HEALING.contains(&e.code()) {
        return error
            .remedy("outboxd sends the batch again from the checkpoint, in order; check the server (INFO)")
            .transient();
    }
    if e.code() == "NOPERM" {
        return error.remedy("grant the user +xadd on the stream keys (and, with checkpoint.store = \"redis\", +watch +get +set on ~outboxd:checkpoint:*), then restart outboxd (nothing was skipped)");
    }
    error.remedy("fix what the server names, then restart outboxd (nothing was skipped)")
}

/// `XADD` (`maxlen`: `MAXLEN ~ n`; never given for a dead-letter stream: parked rows stay until
/// someone looks at them).
pub(super) fn xadd(stream: &str, fields: &[(String, Vec<u8>)], maxlen: Option<u64>) -> redis::Cmd {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream);
    if let Some(n) = maxlen {
        cmd.arg("MAXLEN").arg("~").arg(n);
    }
    cmd.arg("*");
    for (name, value) in fields {
        cmd.arg(name.as_str()).arg(value.as_slice());
    }
    cmd
}

/// The dead-letter copy of an entry for `stream`, whose key holds another type than a stream,
/// or the error that stops outboxd (no dead-letter stream, or the entry is a dead letter already).
pub(super) fn dead_letter_copy(
    dead_letter: Option<&str>,
    stream: &str,
    fields: &Fields,
    dead_lettered: bool,
) -> Result<(String, Fields)> {
    let why = format!("key {stream:?} holds another type than a stream");
    let Some(dead_letter) = dead_letter.filter(|_| !dead_lettered) else {
        let remedy = if dead_lettered {
            "make redis.dead_letter_topic name a stream (or a key that does not exist), then restart outboxd (nothing was skipped)".to_string()
        } else {
            format!("route such rows elsewhere or remove the key {stream:?}, or set redis.dead_letter_topic to park them; then restart outboxd (nothing was skipped)")
        };
        return Err(Error::unroutable(format!("a row cannot be delivered: {why}")).remedy(remedy));
    };
    tracing::warn!(stream = %stream, dead_letter = %dead_letter, "unroutable entry sent to the dead-letter stream");
    let mut fields = fields.clone();
    fields.push((
        "outboxd.error".into(),
        format!("unroutable: {why}").into_bytes(),
    ));
    fields.push(("outboxd.stream".into(), stream.to_string().into_bytes()));
    Ok((dead_letter.to_string(), fields))
}

/// `WAIT n timeout`: every write of this connection so far reached `n` replicas. The server waits
/// at most half of `timeout`, the client no longer than the whole of it (a frozen server answers
/// nothing); fewer replicas is a transient error.
pub(super) async fn wait(
    connection: &mut MultiplexedConnection,
    replicas: u32,
    timeout: Duration,
) -> Result<()> {
    let mut wait = redis::cmd("WAIT");
    wait.arg(replicas).arg(wait_millis(timeout / 2));
    let waiting = wait.query_async::<i64>(connection);
    let reached = tokio::time::timeout(timeout, waiting)
        .await
        .map_err(|_| {
            Error::sink("Redis did not answer WAIT within redis.message_timeout_ms")
                .remedy("outboxd sends again from the checkpoint; check the server")
                .transient()
        })?
        .map_err(|e| command_error("waiting for replicas", &e))?;
    if reached < i64::from(replicas) {
        return Err(Error::sink(format!(
            "only {reached} of redis.wait_replicas = {replicas} replicas had a batch within redis.message_timeout_ms"
        ))
        .remedy("outboxd sends again from the checkpoint (duplicates, no loss); check the replicas (INFO replication)")
        .transient());
    }
    Ok(())
}
