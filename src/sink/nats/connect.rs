//! Connecting to NATS, classifying what it refuses, and `check`'s lines.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, context::Context};
use async_nats::{Client, ConnectErrorKind, ConnectOptions, Event};

use super::config::{check_subject, NatsConfig, UrlAuth};
use super::OPEN_TIMEOUT;
use crate::error::{Error, Result};
use crate::preflight::Item;
use crate::sink::ack::Acks;

/// Connects with the credentials and TLS settings of `config`. With `acks`, a lost connection
/// ends the session (the client would reconnect on its own, but the `PubAck`s of what was in
/// flight are lost with it: the next session publishes again from the checkpoint).
pub(super) async fn connect(
    name: &str,
    config: &NatsConfig,
    acks: Option<Arc<dyn Acks>>,
) -> Result<Client> {
    let shown = super::config::shown_url(&config.url);
    let (servers, url_auth) = config
        .servers()
        .map_err(|why| Error::config(format!("nats.url: {why}")))?;
    let mut options = ConnectOptions::new()
        .name(format!("outboxd-{name}"))
        .connection_timeout(OPEN_TIMEOUT)
        .ping_interval(Duration::from_secs(10))
        // One reconnect attempt, then the client gives up: a session ends on a lost connection
        // anyway, and a client left reconnecting after its session would publish its stale
        // buffer when the server returns.
        .max_reconnects(Some(1));
    match url_auth {
        Some(UrlAuth::User(user, password)) => options = options.user_and_password(user, password),
        Some(UrlAuth::Token(token)) => options = options.token(token),
        None => {}
    }
    if let Some(token) = &config.token {
        options = options.token(token.clone());
    }
    if let Some(path) = &config.credentials_file {
        options = options.credentials_file(path).await.map_err(|e| {
            Error::config(format!(
                "cannot read nats.credentials_file {}: {e}",
                path.display()
            ))
            .remedy("point nats.credentials_file at a readable .creds file (nsc generate creds)")
        })?;
    }
    if let Some(ca) = &config.ca_file {
        if let Err(e) = std::fs::read(ca) {
            return Err(
                Error::config(format!("cannot read nats.ca_file {}: {e}", ca.display()))
                    .remedy("point nats.ca_file at a readable PEM file of the CA(s) to trust"),
            );
        }
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let Some(acks) = acks {
        options = options.event_callback(move |event| {
            let acks = acks.clone();
            async move {
                match event {
                    Event::Disconnected => acks.failed(
                        Error::sink("the connection to NATS was lost")
                            .remedy("outboxd reconnects and publishes again from the checkpoint (the stream drops repeated Nats-Msg-Ids)")
                            .transient(),
                    ),
                    // The server says so on the connection, not in the publish's reply (which
                    // never comes).
                    Event::ServerError(async_nats::ServerError::Other(text))
                        if text.to_ascii_lowercase().contains("permissions violation") =>
                    {
                        acks.failed(
                            Error::sink(format!("NATS refused outboxd's user: {text}"))
                                .remedy("allow the user to publish to the routed subjects and the dead-letter subject, and to subscribe to _INBOX.> (the PubAcks), then restart outboxd (nothing was skipped)"),
                        )
                    }
                    _ => {}
                }
            }
        });
    }
    let servers: Vec<async_nats::ServerAddr> = servers
        .iter()
        .filter_map(|url| url.as_str().parse().ok())
        .collect();
    options
        .connect(servers)
        .await
        .map_err(|e| connect_error(&shown, &e))
}

/// The JetStream context whose `PubAck`s wait at most `timeout`.
pub(super) fn jetstream(client: Client, timeout: Duration, in_flight: usize) -> Context {
    jetstream::context::ContextBuilder::new()
        .timeout(timeout)
        .max_ack_inflight(in_flight)
        .build(client)
}

fn connect_error(shown: &str, e: &async_nats::ConnectError) -> Error {
    let text = e.to_string();
    match e.kind() {
        ConnectErrorKind::Authentication | ConnectErrorKind::AuthorizationViolation => {
            Error::sink(format!("NATS at {shown} refused the login: {text}"))
                .remedy("check the credentials in nats.url, nats.token (OUTBOXD_NATS__TOKEN) or nats.credentials_file")
        }
        ConnectErrorKind::Tls | ConnectErrorKind::Io if certificate_error(&text) => {
            Error::sink(format!("TLS to NATS at {shown} failed: {text}")).remedy(
                "check nats.ca_file and that the server's certificate names the host in nats.url",
            )
        }
        ConnectErrorKind::ServerParse => Error::config(format!("nats.url: {text}"))
            .remedy("write url = \"nats://host:4222\""),
        _ => Error::sink(format!("cannot reach NATS at {shown}: {text}"))
            .remedy("outboxd retries; check nats.url and that nats-server is up")
            .transient(),
    }
}

fn certificate_error(text: &str) -> bool {
    let text = text.to_ascii_lowercase();
    text.contains("certificate")
        || text.contains("unknownissuer")
        || text.contains("notvalidforname")
}

/// `check`'s lines for the NATS sink: the server is reachable with these credentials, JetStream
/// is on, the subjects outboxd can know before running (a fixed route topic, the dead-letter
/// subject) are captured by a stream, and those streams' duplicate windows outlast the delivery
/// timeout (so a message published again after a timeout is still recognised).
pub async fn preflight(config: &NatsConfig, fixed_topic: Option<&str>) -> Vec<Item> {
    let shown = super::config::shown_url(&config.url);
    let client = match tokio::time::timeout(OPEN_TIMEOUT, connect("check", config, None)).await {
        Ok(Ok(client)) => client,
        Ok(Err(e)) => return vec![as_item("nats", &e)],
        Err(_) => {
            return vec![Item::unreachable(
                "nats",
                format!("NATS at {shown} did not answer within {OPEN_TIMEOUT:?}"),
                "check that nats-server is up",
            )]
        }
    };
    let info = client.server_info();
    let mut items = vec![Item::pass(
        "nats",
        format!(
            "connected to {shown} (nats-server {}, max_payload {} bytes)",
            info.version, info.max_payload
        ),
    )];
    if config.max_message_bytes > info.max_payload {
        items.push(Item::warn(
            "nats max_payload",
            format!(
                "nats.max_message_bytes ({}) is above the server's max_payload ({}): rows in between are dead-lettered as too_large by the sink (or stop outboxd without a dead-letter subject)",
                config.max_message_bytes, info.max_payload
            ),
            "set nats.max_message_bytes below max_payload, or raise max_payload in the server's config",
        ));
    }
    match account_streams(&client).await {
        Ok(streams) => items.push(Item::pass(
            "nats jetstream",
            format!("enabled ({streams} streams in the account)"),
        )),
        Err(why) => {
            items.push(Item::fail(
                "nats jetstream",
                format!("JetStream does not answer: {why}"),
                "start nats-server with JetStream on (-js, or jetstream {} in its config) and enable it for this account",
            ));
            return items;
        }
    }
    let context = jetstream(client, OPEN_TIMEOUT, 16);
    let subjects = fixed_topic.map(|t| ("nats subject", t)).into_iter().chain(
        config
            .dead_letter_topic
            .as_deref()
            .map(|t| ("nats dead-letter subject", t)),
    );
    for (what, subject) in subjects {
        items.push(subject_item(&context, config, what, subject).await);
    }
    items
}

/// The number of streams in the account, asked of `$JS.API.INFO` directly: async-nats's account
/// type wants fields nats-server 2.9 (Debian 12's) does not send.
async fn account_streams(client: &Client) -> std::result::Result<u64, String> {
    let reply = tokio::time::timeout(
        OPEN_TIMEOUT,
        client.request("$JS.API.INFO", bytes::Bytes::new()),
    )
    .await
    .map_err(|_| "no answer".to_string())?
    .map_err(|e| e.to_string())?;
    let info: serde_json::Value =
        serde_json::from_slice(&reply.payload).map_err(|e| e.to_string())?;
    if let Some(error) = info.get("error") {
        return Err(error["description"]
            .as_str()
            .unwrap_or("an error")
            .to_string());
    }
    Ok(info["streams"].as_u64().unwrap_or(0))
}

async fn subject_item(context: &Context, config: &NatsConfig, what: &str, subject: &str) -> Item {
    if let Err(why) = check_subject(subject) {
        return Item::fail(what, why, "route rows to a valid subject");
    }
    let stream = match context.stream_by_subject(subject).await {
        Ok(stream) => stream,
        Err(e) if matches!(e.kind(), async_nats::jetstream::context::GetStreamByNameErrorKind::NotFound) => {
            return Item::fail(
                what,
                format!("no stream captures {subject:?}: outboxd would dead-letter or stop at its first row"),
                format!("add one: nats stream add OUTBOX --subjects \"{subject}\" --storage file --dupe-window 2m (or add the subject to an existing stream)"),
            )
        }
        Err(e) => {
            return Item::unreachable(what, format!("cannot ask which stream captures {subject:?}: {e}"), "check the server and the user's permission on $JS.API.>")
        }
    };
    match context.get_stream(&stream).await {
        Ok(mut s) => match s.info().await {
            Ok(info) if !super::stream::costs(info).is_empty() => {
                let mut item = costly_stream_item(what, subject, &stream, info, config);
                if info.config.duplicate_window < config.message_timeout() {
                    item.detail.push_str(&format!(
                        "; its duplicate window ({:?}) is shorter than nats.message_timeout_ms ({:?}): a message published again after a timeout may be stored twice",
                        info.config.duplicate_window,
                        config.message_timeout()
                    ));
                }
                item
            }
            Ok(info) if info.config.duplicate_window < config.message_timeout() => Item::warn(
                what,
                format!(
                    "{subject:?} is captured by stream {stream:?}, whose duplicate window ({:?}) is shorter than nats.message_timeout_ms ({:?}): a message published again after a timeout may be stored twice",
                    info.config.duplicate_window,
                    config.message_timeout()
                ),
                format!("nats stream edit {stream} --dupe-window 2m (or lower nats.message_timeout_ms)"),
            ),
            Ok(info) => Item::pass(
                what,
                format!(
                    "{subject:?} is captured by stream {stream:?} (duplicate window {:?})",
                    info.config.duplicate_window
                ),
            ),
            Err(e) => Item::unreachable(what, format!("cannot read stream {stream:?}: {e}"), "check the server"),
        },
        Err(e) => Item::unreachable(what, format!("cannot read stream {stream:?}: {e}"), "check the server"),
    }
}

/// The item for a stream whose settings cost rows: FAIL when it cannot work or (unless
/// `nats.allow_lossy_streams`) loses acknowledged messages, WARN otherwise; every cost named.
fn costly_stream_item(
    what: &str,
    subject: &str,
    stream: &str,
    info: &async_nats::jetstream::stream::Info,
    config: &NatsConfig,
) -> Item {
    use super::stream::Cost;
    let costs = super::stream::costs(info);
    let text: Vec<&str> = costs
        .iter()
        .map(|c| match c {
            Cost::Broken(t) | Cost::Loses(t) | Cost::Drops(t) => t.as_str(),
        })
        .collect();
    let message = format!(
        "{subject:?} is captured by stream {stream:?}: {}",
        text.join("; ")
    );
    let fix = super::stream::remedy(stream, subject);
    let broken = costs.iter().any(|c| matches!(c, Cost::Broken(_)));
    let loses = costs.iter().any(|c| matches!(c, Cost::Loses(_)));
    if broken {
        Item::fail(what, message, fix)
    } else if loses && !config.allow_lossy_streams {
        Item::fail(
            what,
            message,
            format!("{fix}; or set nats.allow_lossy_streams = true to accept the loss"),
        )
    } else {
        Item::warn(what, message, fix)
    }
}

fn as_item(subject: &str, e: &Error) -> Item {
    let remedy = e.remedy_text().unwrap_or("see the message").to_string();
    if e.is_transient() {
        Item::unreachable(subject, e.message(), remedy)
    } else {
        Item::fail(subject, e.message(), remedy)
    }
}
