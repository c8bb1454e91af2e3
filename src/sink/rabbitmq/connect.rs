//! Connecting to RabbitMQ, classifying what it refuses, and `check`'s lines.

use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{FieldTable, LongString};
use lapin::{Channel, Connection, ConnectionProperties};

use super::config::RabbitMqConfig;
use super::{CLOSE_TIMEOUT, OPEN_TIMEOUT};
use crate::error::{Error, Result};
use crate::preflight::Item;
use crate::source::config::redact_url;

/// The session's connection and its publishing channel: the exchange checked, confirm mode on.
pub(super) async fn open(name: &str, config: &RabbitMqConfig) -> Result<(Connection, Channel)> {
    let connection = connect(name, config).await?;
    let channel = connection.create_channel().await.map_err(|e| {
        Error::sink(format!("cannot open a RabbitMQ channel: {e}"))
            .remedy("outboxd retries; check the broker's channel_max and logs")
            .transient()
    })?;
    check_exchange(&channel, &config.exchange).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| {
            Error::sink(format!("cannot turn on publisher confirms: {e}"))
                .remedy("outboxd retries; publisher confirms are part of every RabbitMQ since 2.x")
                .transient()
        })?;
    Ok((connection, channel))
}

pub(super) async fn connect(name: &str, config: &RabbitMqConfig) -> Result<Connection> {
    let runtime = lapin::runtime::default_runtime()
        .map_err(|e| Error::sink(format!("no async runtime for RabbitMQ: {e}")))?;
    let cert_chain = match &config.ca_file {
        Some(path) => Some(std::fs::read_to_string(path).map_err(|e| {
            Error::config(format!(
                "cannot read rabbitmq.ca_file {}: {e}",
                path.display()
            ))
            .remedy("point rabbitmq.ca_file at a readable PEM file of the CA(s) to trust")
        })?),
        None => None,
    };
    let tls = lapin::tcp::OwnedTLSConfig {
        identity: None,
        cert_chain,
    };
    let properties = ConnectionProperties::default()
        .with_connection_name(LongString::from(format!("outboxd-{name}")));
    Connection::connect_with_config(&config.url, properties, tls, runtime)
        .await
        .map_err(|e| connect_error(&config.url, &e))
}

/// The AMQP reply code of a broker-sent error (403 access refused, 404 not found, 406
/// precondition failed, 530 not allowed, 501 frame error, …).
fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

/// A TLS failure the operator must fix (the certificate does not verify), as opposed to a
/// connection cut during the handshake, which a retry cures.
fn certificate_error(e: &lapin::Error) -> bool {
    let text = e.to_string().to_ascii_lowercase();
    matches!(e.kind(), lapin::ErrorKind::IOError(_))
        && (text.contains("certificate") || text.contains("hostname mismatch"))
}

/// A connection failure, classified by what the broker said: a refused login or vhost is the
/// operator's to fix (retrying only fills the broker's log), the rest is retried.
fn connect_error(url: &str, e: &lapin::Error) -> Error {
    let shown = redact_url(url);
    let text = e.to_string();
    match reply_code(e) {
        Some(403) => Error::sink(format!("RabbitMQ at {shown} refused the login: {text}"))
            .remedy("check the user and password in rabbitmq.url (or OUTBOXD_RABBITMQ__URL)"),
        // "access to vhost refused" is for the operator; "vhost is down" passes.
        Some(530) if text.contains("refused") || text.contains("not found") => {
            Error::sink(format!("RabbitMQ at {shown} refused the virtual host: {text}"))
                .remedy("name an existing vhost in rabbitmq.url (%2f is /) and grant the user access to it (rabbitmqctl set_permissions -p VHOST USER '' '.*' '.*')")
        }
        _ if certificate_error(e) => {
            Error::sink(format!("TLS to RabbitMQ at {shown} failed: {text}"))
                .remedy("check rabbitmq.ca_file and that the broker's certificate names the host in rabbitmq.url")
        }
        _ => Error::sink(format!("cannot reach RabbitMQ at {shown}: {text}"))
            .remedy("outboxd retries; check rabbitmq.url and that the broker is up")
            .transient(),
    }
}

/// A publish or a confirm failed because the broker closed the channel or the connection.
pub(super) fn channel_error(doing: &str, e: &lapin::Error) -> Error {
    let text = e.to_string();
    match reply_code(e) {
        Some(404) => Error::sink(format!("RabbitMQ closed the channel while {doing}: {text}"))
            .remedy("create the exchange named by rabbitmq.exchange, then restart outboxd (nothing was skipped)"),
        Some(403) => Error::sink(format!("RabbitMQ refused outboxd's user while {doing}: {text}"))
            .remedy("grant the user write permission on the exchange (rabbitmqctl set_permissions), then restart outboxd (nothing was skipped)"),
        Some(406) if text.contains("message size") => {
            Error::unroutable(format!("RabbitMQ refused a message while {doing}: {text}"))
                .remedy("set rabbitmq.max_message_bytes to the broker's max_message_size (larger rows are then dead-lettered), or raise that setting; nothing was skipped")
        }
        _ => Error::sink(format!("RabbitMQ channel failed while {doing}: {text}"))
            .remedy("outboxd reconnects and publishes again from the checkpoint")
            .transient(),
    }
}

/// `exchange` exists (checked passively: outboxd declares nothing). The default exchange (`""`)
/// always does.
async fn check_exchange(channel: &Channel, exchange: &str) -> Result<()> {
    if exchange.is_empty() {
        return Ok(());
    }
    channel
        .exchange_declare(
            exchange.into(),
            lapin::ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|e| {
            let text = e.to_string();
            if text.contains("NOT_FOUND") {
                Error::sink(format!("RabbitMQ has no exchange {exchange:?}"))
                    .remedy(format!("declare it (rabbitmqadmin declare exchange name={exchange} type=topic durable=true) or fix rabbitmq.exchange"))
            } else {
                Error::sink(format!("cannot check RabbitMQ exchange {exchange:?}: {text}"))
                    .remedy("outboxd retries; check the broker")
                    .transient()
            }
        })
}

/// `check`'s lines for the RabbitMQ sink: the broker is reachable with these credentials and the
/// exchange exists. (Whether a binding routes each routing key cannot be asked over AMQP 0.9.1: a
/// message no binding routes is returned at run time, see the module docs.)
pub async fn preflight(config: &RabbitMqConfig) -> Vec<Item> {
    let as_item = |subject: &str, e: &Error| {
        let remedy = e.remedy_text().unwrap_or("see the message").to_string();
        if e.is_transient() {
            Item::unreachable(subject, e.message(), remedy)
        } else {
            Item::fail(subject, e.message(), remedy)
        }
    };
    let shown = redact_url(&config.url);
    let connection = match tokio::time::timeout(OPEN_TIMEOUT, connect("check", config)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return vec![as_item("rabbitmq", &e)],
        Err(_) => {
            return vec![Item::unreachable(
                "rabbitmq",
                format!("RabbitMQ at {shown} did not answer within {OPEN_TIMEOUT:?}"),
                "check that the broker is up and not blocked (rabbitmq-diagnostics status)",
            )]
        }
    };
    let mut items = vec![Item::pass("rabbitmq", format!("connected to {shown}"))];
    let checking = async {
        match connection.create_channel().await {
            Ok(channel) => check_exchange(&channel, &config.exchange).await,
            Err(e) => Err(channel_error("opening a channel", &e)),
        }
    };
    let checked = tokio::time::timeout(OPEN_TIMEOUT, checking)
        .await
        .unwrap_or_else(|_| {
            Err(Error::sink(format!(
                "RabbitMQ at {shown} did not answer the exchange check"
            ))
            .remedy("check that the broker is up and not blocked")
            .transient())
        });
    items.push(match checked {
        Ok(()) if config.exchange.is_empty() => Item::pass(
            "rabbitmq exchange",
            "the default exchange: each routed topic must name a queue",
        ),
        Ok(()) => Item::pass("rabbitmq exchange", format!("{:?} exists", config.exchange)),
        Err(e) => as_item("rabbitmq exchange", &e),
    });
    let _ = tokio::time::timeout(
        CLOSE_TIMEOUT,
        connection.close(200, "outboxd check done".into()),
    )
    .await;
    items
}
