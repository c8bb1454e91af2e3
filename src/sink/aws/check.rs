//! `check`'s lines for `[sqs]` and `[sns]`: credentials found, and for the route's fixed
//! destination and the dead-letter one: exists and answers these credentials, FIFO or not, its
//! size limit and de-duplication.

use aws_sdk_sqs::config::ProvideCredentials;

use super::config::{AwsConfig, Service};
use super::service::{self, Client, Destination};
use crate::error::Error;
use crate::preflight::Item;

pub async fn preflight(
    service: Service,
    config: &AwsConfig,
    fixed_topic: Option<&str>,
) -> Vec<Item> {
    let section = service.section();
    let sdk = match service::sdk_config(config).await {
        Ok(sdk) => sdk,
        Err(e) => return vec![as_item(section, &e)],
    };
    let region = sdk.region().map(|r| r.to_string()).unwrap_or_default();
    let Some(credentials) = sdk.credentials_provider() else {
        return vec![Item::fail(
            section,
            "no AWS credentials provider",
            "set AWS credentials (env, profile, web identity or an instance role)",
        )];
    };
    if let Err(e) = credentials.provide_credentials().await {
        return vec![Item::fail(
            section,
            format!("no AWS credentials: {}", aws_sdk_sqs::error::DisplayErrorContext(&e)),
            "give outboxd credentials through the AWS chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, web identity (EKS), or an instance/task role",
        )];
    }
    let mut items = vec![Item::pass(
        section,
        format!(
            "credentials found; region {region}{}",
            config
                .endpoint_url
                .as_deref()
                .map(|e| format!(", endpoint {}", crate::source::config::redact_url(e)))
                .unwrap_or_default()
        ),
    )];
    let client = Client::new(service, &sdk);
    let named = fixed_topic
        .map(|t| (format!("{section} {}", service.noun()), t, false))
        .into_iter()
        .chain(
            config
                .dead_letter_topic
                .as_deref()
                .map(|t| (format!("{section} dead-letter {}", service.noun()), t, true)),
        );
    for (what, name, dead_letters) in named {
        items.push(destination_item(&client, config, &what, name, dead_letters).await);
    }
    items
}

/// `dead_letters`: the destination is the dead-letter one, whose FIFO item says what FIFO means
/// for dead letters.
async fn destination_item(
    client: &Client,
    config: &AwsConfig,
    what: &str,
    name: &str,
    dead_letters: bool,
) -> Item {
    let service = client.service();
    if let Err(why) = super::config::check_name(service, name) {
        return Item::fail(what, why, "route to a valid name");
    }
    let template = config.template(service);
    match client.resolve(name, template, config).await {
        Ok(Some(destination)) => {
            if client
                .has_confirmed_subscription(&destination.address)
                .await
                == Some(false)
            {
                let kind = if destination.fifo {
                    "a FIFO topic"
                } else {
                    "a standard topic (per-key order is best-effort there, and a resend after a crash is a duplicate)"
                };
                return Item::warn(
                    what,
                    format!(
                        "{name:?} ({}) has no confirmed subscription: SNS accepts each message published to it and delivers it nowhere, and outboxd counts it delivered. It is {kind}",
                        destination.address
                    ),
                    "subscribe the consumers' queues or endpoints (aws sns subscribe --topic-arn … --protocol sqs --notification-endpoint …) and confirm them before forwarding; a subscription's filter policy can also drop messages",
                );
            }
            judged(service, what, &destination, dead_letters)
        }
        Ok(None) => Item::fail(
            what,
            format!("{name:?} does not exist (or these credentials cannot see it)"),
            match service {
                Service::Sqs => format!(
                    "aws sqs create-queue --queue-name {name}{}",
                    if name.ends_with(".fifo") {
                        " --attributes FifoQueue=true"
                    } else {
                        ""
                    }
                ),
                Service::Sns => format!(
                    "aws sns create-topic --name {name}{}",
                    if name.ends_with(".fifo") {
                        " --attributes FifoTopic=true"
                    } else {
                        ""
                    }
                ),
            },
        ),
        Err(failure) => {
            let grant = match service {
                Service::Sqs => "sqs:GetQueueUrl, sqs:GetQueueAttributes and sqs:SendMessage",
                Service::Sns => "sns:ListTopics, sns:GetTopicAttributes and sns:Publish",
            };
            let e = failure.error(
                service,
                name,
                &format!("allow {grant} to the credentials outboxd runs with"),
            );
            as_item(what, &e)
        }
    }
}

fn judged(service: Service, what: &str, d: &Destination, dead_letters: bool) -> Item {
    let dedup = if d.content_dedup { "on" } else { "off" };
    if d.fifo {
        let ids = if dead_letters {
            "a dead letter keeps its row's id and key; one the router made has neither: its outboxd.row (the pipeline, the transaction's position and the row's place in it) is its de-duplication id and it joins the message group outboxd.no-key, so those go one after another, and a repeat within 5 minutes is dropped"
        } else {
            "outboxd sets the row id as the de-duplication id and the key as the message group"
        };
        Item::pass(
            what,
            format!(
                "{:?} is FIFO ({}), max message {} bytes, content-based de-duplication {dedup} ({ids})",
                d.name, d.address, d.max_bytes
            ),
        )
    } else {
        Item::warn(
            what,
            format!(
                "{:?} is a standard {} ({}), max message {} bytes: per-key order is best-effort there, and a resend after a crash is a duplicate",
                d.name,
                service.noun(),
                d.address,
                d.max_bytes
            ),
            format!(
                "use a FIFO {} (name ending in .fifo) where consumers need each key's order; otherwise make consumers drop repeats by the id attribute",
                service.noun()
            ),
        )
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
