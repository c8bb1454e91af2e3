//! The AWS calls the sinks make, each answered in outboxd's terms: a destination found (or not),
//! a batch's per-entry outcomes, or a [`Failure`] that says whether waiting can cure it. The AWS
//! SDK signs, resolves credentials and speaks each service's protocol; nothing above this file
//! sees an SDK type.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use aws_sdk_sqs::config::http::HttpResponse;
use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use tokio::sync::Mutex;

use super::config::{AwsConfig, Service};
use super::message::{Message, Value};
use crate::error::{Error, Result};

/// Where a routed topic's messages go, as read when it was first used.
#[derive(Debug, Clone)]
pub struct Destination {
    /// The routed topic (queue or topic name).
    pub name: String,
    /// The queue URL or topic ARN.
    pub address: String,
    pub fifo: bool,
    /// The largest message it takes (SQS: the queue's `MaximumMessageSize`), and so the largest
    /// batch.
    pub max_bytes: usize,
    pub content_dedup: bool,
}

/// A refused or unanswered call, or a refused entry of a batch.
#[derive(Debug, Clone)]
pub struct Failure {
    pub code: String,
    pub text: String,
    /// Throttling, a server error, a lost connection: the same call may succeed later.
    pub transient: bool,
    /// The queue or topic does not exist.
    pub missing: bool,
}

/// What became of one entry of a batch.
#[derive(Debug, Clone)]
pub enum Outcome {
    Stored,
    Failed(Failure),
}

/// How long the SNS topic list is trusted.
const TOPICS_TTL: Duration = Duration::from_secs(60);

pub enum Client {
    Sqs(aws_sdk_sqs::Client),
    Sns(
        aws_sdk_sns::Client,
        Mutex<Option<(Instant, HashMap<String, String>)>>,
    ),
}

impl Client {
    pub fn new(service: Service, sdk: &aws_config::SdkConfig) -> Client {
        match service {
            Service::Sqs => Client::Sqs(aws_sdk_sqs::Client::new(sdk)),
            Service::Sns => Client::Sns(aws_sdk_sns::Client::new(sdk), Mutex::new(None)),
        }
    }

    pub fn service(&self) -> Service {
        match self {
            Client::Sqs(_) => Service::Sqs,
            Client::Sns(..) => Service::Sns,
        }
    }

    /// The destination `name` stands for (`template`: its address with `${topic}`), or `None`
    /// when it does not exist.
    pub async fn resolve(
        &self,
        name: &str,
        template: Option<&str>,
        config: &AwsConfig,
    ) -> std::result::Result<Option<Destination>, Failure> {
        let address = match template {
            Some(template) => template.replace("${topic}", name),
            None => match self.address(name).await? {
                Some(address) => address,
                None => return Ok(None),
            },
        };
        let (fifo, max_bytes, content_dedup) = match self {
            Client::Sqs(sqs) => {
                let answer = sqs
                    .get_queue_attributes()
                    .queue_url(&address)
                    .attribute_names(aws_sdk_sqs::types::QueueAttributeName::All)
                    .send()
                    .await;
                let attributes = match answer {
                    Ok(answer) => answer.attributes().cloned().unwrap_or_default(),
                    Err(e) => match failure("GetQueueAttributes", e) {
                        f if f.missing => return Ok(None),
                        f => return Err(f),
                    },
                };
                use aws_sdk_sqs::types::QueueAttributeName as A;
                let get = |a: A| attributes.get(&a).map(String::as_str);
                (
                    get(A::FifoQueue) == Some("true"),
                    get(A::MaximumMessageSize)
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(super::config::MAX_MESSAGE_BYTES),
                    get(A::ContentBasedDeduplication) == Some("true"),
                )
            }
            Client::Sns(sns, _) => {
                let answer = sns.get_topic_attributes().topic_arn(&address).send().await;
                let attributes = match answer {
                    Ok(answer) => answer.attributes().cloned().unwrap_or_default(),
                    Err(e) => match failure("GetTopicAttributes", e) {
                        f if f.missing => return Ok(None),
                        f => return Err(f),
                    },
                };
                (
                    attributes.get("FifoTopic").map(String::as_str) == Some("true"),
                    super::config::MAX_MESSAGE_BYTES,
                    attributes
                        .get("ContentBasedDeduplication")
                        .map(String::as_str)
                        == Some("true"),
                )
            }
        };
        Ok(Some(Destination {
            name: name.to_string(),
            address,
            fifo,
            max_bytes: max_bytes.min(config.max_message_bytes.max(1024)),
            content_dedup,
        }))
    }

    /// SNS: whether topic `arn` has at least one confirmed subscription; `None` for SQS. Asked by
    /// `check` only. The topic's `SubscriptionsConfirmed` attribute answers when it says some (AWS
    /// keeps it, with a delay of about a minute); when it says none, the subscriptions are listed
    /// (emulators such as moto leave the attribute at 0), and if listing is refused or does not
    /// end within a few pages, the attribute's 0 stands.
    pub async fn has_confirmed_subscription(&self, arn: &str) -> Option<bool> {
        let Client::Sns(sns, _) = self else {
            return None;
        };
        let confirmed: Option<u64> = sns
            .get_topic_attributes()
            .topic_arn(arn)
            .send()
            .await
            .ok()
            .and_then(|a| {
                a.attributes()
                    .and_then(|a| a.get("SubscriptionsConfirmed").cloned())
            })
            .and_then(|n| n.parse().ok());
        match confirmed {
            Some(n) if n > 0 => return Some(true),
            None => return None,
            Some(_) => {}
        }
        Some(
            self.lists_a_confirmed_subscription(sns, arn)
                .await
                .unwrap_or(false),
        )
    }

    /// Whether `ListSubscriptionsByTopic` shows a confirmed subscription of `arn` (`None`: refused,
    /// or no answer within 10 pages).
    async fn lists_a_confirmed_subscription(
        &self,
        sns: &aws_sdk_sns::Client,
        arn: &str,
    ) -> Option<bool> {
        let mut next: Option<String> = None;
        // A few pages are enough to find one confirmed subscription among many pending ones.
        for _ in 0..10 {
            let page = sns
                .list_subscriptions_by_topic()
                .topic_arn(arn)
                .set_next_token(next.take())
                .send()
                .await
                .ok()?;
            if page
                .subscriptions()
                .iter()
                .any(|s| s.subscription_arn().is_some_and(|a| a.starts_with("arn:")))
            {
                return Some(true);
            }
            match page.next_token() {
                Some(token) => next = Some(token.to_string()),
                None => return Some(false),
            }
        }
        None
    }

    /// The queue URL or topic ARN of `name`, looked up.
    async fn address(&self, name: &str) -> std::result::Result<Option<String>, Failure> {
        match self {
            Client::Sqs(sqs) => match sqs.get_queue_url().queue_name(name).send().await {
                Ok(answer) => Ok(answer.queue_url().map(str::to_string)),
                Err(e) => match failure("GetQueueUrl", e) {
                    f if f.missing => Ok(None),
                    f => Err(f),
                },
            },
            Client::Sns(sns, cache) => {
                let mut cache = cache.lock().await;
                // A fresh list answers misses too: routing values naming no topic must not list
                // every topic again each time.
                if let Some((read, topics)) = cache.as_ref() {
                    if read.elapsed() < TOPICS_TTL {
                        return Ok(topics.get(name).cloned());
                    }
                }
                let mut topics = HashMap::new();
                let mut next: Option<String> = None;
                loop {
                    let page = sns
                        .list_topics()
                        .set_next_token(next.take())
                        .send()
                        .await
                        .map_err(|e| failure("ListTopics", e))?;
                    for arn in page.topics().iter().filter_map(|t| t.topic_arn()) {
                        if let Some((_, topic)) = arn.rsplit_once(':') {
                            topics.insert(topic.to_string(), arn.to_string());
                        }
                    }
                    match page.next_token() {
                        Some(token) if !token.is_empty() => next = Some(token.to_string()),
                        _ => break,
                    }
                }
                let found = topics.get(name).cloned();
                *cache = Some((Instant::now(), topics));
                Ok(found)
            }
        }
    }

    /// Sends `messages` (at most 10) in one `SendMessageBatch` / `PublishBatch`; the outcomes
    /// are in the messages' order.
    pub async fn send_batch(
        &self,
        destination: &Destination,
        messages: &[&Message],
    ) -> std::result::Result<Vec<Outcome>, Failure> {
        let failed = |id: &str, code: &str, message: Option<&str>, sender_fault: bool| {
            (id.to_string(), entry_failure(code, message, sender_fault))
        };
        match self {
            Client::Sqs(sqs) => {
                let entries = messages
                    .iter()
                    .enumerate()
                    .map(|(i, m)| sqs_entry(i, m, destination))
                    .collect();
                let answer = sqs
                    .send_message_batch()
                    .queue_url(&destination.address)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .map_err(|e| failure("SendMessageBatch", e))?;
                Ok(outcomes(
                    messages.len(),
                    answer.successful().iter().map(|s| s.id()),
                    answer
                        .failed()
                        .iter()
                        .map(|f| failed(f.id(), f.code(), f.message(), f.sender_fault())),
                ))
            }
            Client::Sns(sns, _) => {
                let entries = messages
                    .iter()
                    .enumerate()
                    .map(|(i, m)| sns_entry(i, m, destination))
                    .collect();
                let answer = sns
                    .publish_batch()
                    .topic_arn(&destination.address)
                    .set_publish_batch_request_entries(Some(entries))
                    .send()
                    .await
                    .map_err(|e| failure("PublishBatch", e))?;
                Ok(outcomes(
                    messages.len(),
                    answer.successful().iter().filter_map(|s| s.id()),
                    answer
                        .failed()
                        .iter()
                        .map(|f| failed(f.id(), f.code(), f.message(), f.sender_fault())),
                ))
            }
        }
    }
}

/// A batch reply's entries, by the ids outboxd gave them (their places in the batch), as one
/// outcome per message in order. An entry the reply does not mention was not stored as far as
/// outboxd can tell: sent again (FIFO drops the repeat by its de-duplication id).
fn outcomes<'a>(
    len: usize,
    stored: impl Iterator<Item = &'a str>,
    failed: impl Iterator<Item = (String, Failure)>,
) -> Vec<Outcome> {
    let mut outcomes = vec![None; len];
    let mut settle = |id: &str, outcome: Outcome| {
        // Only the ids outboxd gave ("0" to "9"), spelled as it spelled them.
        let place = id.parse::<usize>().ok().filter(|i| i.to_string() == id);
        if let Some(slot) = place.and_then(|i| outcomes.get_mut(i)) {
            *slot = Some(outcome);
        }
    };
    for id in stored {
        settle(id, Outcome::Stored);
    }
    for (id, why) in failed {
        settle(&id, Outcome::Failed(why));
    }
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(|| Outcome::Failed(not_in_reply())))
        .collect()
}

/// The failure of an entry a batch reply does not answer for: transient, so it goes again.
pub(super) fn not_in_reply() -> Failure {
    Failure {
        code: "NotInReply".into(),
        text: "the batch reply does not mention this entry".into(),
        transient: true,
        missing: false,
    }
}

/// One batch entry, for either SDK: their entry and attribute types are twins generated from the
/// same shapes, so one body serves both.
macro_rules! batch_entry {
    ($sdk:ident, $entry:ident, $body:ident, $i:expr, $m:expr, $destination:expr) => {{
        use $sdk::primitives::Blob;
        use $sdk::types::{$entry, MessageAttributeValue};
        let (m, destination): (&Message, &Destination) = ($m, $destination);
        let attributes: HashMap<String, MessageAttributeValue> = m
            .attributes
            .iter()
            .filter_map(|(name, value)| {
                let v = match value {
                    Value::Text(t) => MessageAttributeValue::builder()
                        .data_type("String")
                        .string_value(t),
                    Value::Binary(b) => MessageAttributeValue::builder()
                        .data_type("Binary")
                        .binary_value(Blob::new(b.clone())),
                };
                // Only a missing data type fails, and it is always set.
                Some((name.clone(), v.build().ok()?))
            })
            .collect();
        let mut entry = $entry::builder()
            .id($i.to_string())
            .$body(&m.body)
            .set_message_attributes((!attributes.is_empty()).then_some(attributes));
        if destination.fifo {
            entry = entry
                .message_group_id(&m.group)
                .message_deduplication_id(&m.dedup);
        }
        entry.build().expect("the id and the body are set")
    }};
}

fn sqs_entry(
    i: usize,
    m: &Message,
    destination: &Destination,
) -> aws_sdk_sqs::types::SendMessageBatchRequestEntry {
    batch_entry!(
        aws_sdk_sqs,
        SendMessageBatchRequestEntry,
        message_body,
        i,
        m,
        destination
    )
}

fn sns_entry(
    i: usize,
    m: &Message,
    destination: &Destination,
) -> aws_sdk_sns::types::PublishBatchRequestEntry {
    batch_entry!(
        aws_sdk_sns,
        PublishBatchRequestEntry,
        message,
        i,
        m,
        destination
    )
}

/// Codes that time heals: throttling, the service's own trouble, credentials being refreshed.
pub(super) fn transient_code(code: &str) -> bool {
    let code = code.rsplit('.').next().unwrap_or(code);
    code.contains("Throttl")
        || matches!(
            code,
            "RequestThrottled"
                | "RequestLimitExceeded"
                | "TooManyRequestsException"
                | "ServiceUnavailable"
                | "InternalError"
                | "InternalFailure"
                | "InternalErrorException"
                | "RequestTimeout"
                | "KMSThrottlingException"
                | "KmsThrottled"
                | "KMSUnavailable"
                | "NotInReply"
        )
}

fn missing_code(code: &str) -> bool {
    matches!(
        code,
        "AWS.SimpleQueueService.NonExistentQueue"
            | "QueueDoesNotExist"
            | "NonExistentQueue"
            | "NotFound"
            | "NotFoundException"
    )
}

/// One refused entry of a reply (`sender_fault`: the service blames the request), classed.
pub(super) fn entry_failure(code: &str, message: Option<&str>, sender_fault: bool) -> Failure {
    Failure {
        code: code.to_string(),
        text: format!("{code}: {}", message.unwrap_or("(no message)")),
        transient: !sender_fault || transient_code(code),
        missing: missing_code(code),
    }
}

/// A failed call as a [`Failure`]: the service's code when it answered, transient when it did
/// not (timeout, connection) or answered with throttling or a server error.
fn failure<E>(call: &str, e: SdkError<E, HttpResponse>) -> Failure
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let mut text = format!("{call}: {}", DisplayErrorContext(&e));
    // A signature refusal quotes the canonical request, session token included.
    if let Some(at) = text.find("The Canonical String") {
        text.truncate(at);
        text.push_str("(the canonical request is not shown)");
    }
    match &e {
        SdkError::ServiceError(service) => {
            let code = service.err().code().unwrap_or("").to_string();
            let status = service.raw().status().as_u16();
            Failure {
                transient: status >= 500 || status == 429 || transient_code(&code),
                missing: missing_code(&code),
                code,
                text,
            }
        }
        SdkError::TimeoutError(_) => Failure {
            code: "Unanswered".into(),
            text,
            transient: true,
            missing: false,
        },
        // A lost or refused connection heals; no credentials or no auth scheme does not, and a
        // reply that is not the service's means endpoint_url names something else.
        SdkError::DispatchFailure(d) if d.is_timeout() || d.is_io() => Failure {
            code: "Unanswered".into(),
            text,
            transient: true,
            missing: false,
        },
        _ => Failure {
            code: "Refused".into(),
            text,
            transient: false,
            missing: false,
        },
    }
}

impl Failure {
    /// As outboxd's error: transient ones end the session (sent again from the checkpoint); the
    /// others stop outboxd with `remedy`.
    pub fn error(&self, service: Service, destination: &str, remedy: &str) -> Error {
        let e = Error::sink(format!(
            "{} {} {destination:?}: {}",
            service.section().to_uppercase(),
            service.noun(),
            self.text
        ));
        if self.transient {
            e.remedy("outboxd sends again from the checkpoint (FIFO drops repeats by their de-duplication id within 5 minutes)")
                .transient()
        } else {
            e.remedy(remedy.to_string())
        }
    }
}

/// The SDK's settings: credentials from the standard chain, `region` and `endpoint_url` from the
/// section when set, HTTPS by rustls with ring, and attempts bounded in time.
pub async fn sdk_config(config: &AwsConfig) -> Result<aws_config::SdkConfig> {
    use aws_config::retry::RetryConfig;
    use aws_config::timeout::TimeoutConfig;
    use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider};
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .http_client(http)
        .retry_config(RetryConfig::standard().with_max_attempts(2))
        .timeout_config(
            TimeoutConfig::builder()
                .connect_timeout(Duration::from_secs(5))
                .operation_attempt_timeout(config.message_timeout().min(Duration::from_secs(20)))
                .operation_timeout(config.message_timeout())
                .build(),
        );
    if let Some(region) = &config.region {
        loader = loader.region(aws_config::Region::new(region.clone()));
    }
    if let Some(endpoint) = &config.endpoint_url {
        loader = loader.endpoint_url(endpoint);
    }
    let sdk = loader.load().await;
    // The secrets the chain found (a profile, a role, web identity) join the scrubber, as the
    // environment's did at load; a failure here shows at the first call instead.
    if let Some(provider) = sdk.credentials_provider() {
        use aws_sdk_sqs::config::ProvideCredentials;
        if let Ok(Ok(credentials)) =
            tokio::time::timeout(Duration::from_secs(10), provider.provide_credentials()).await
        {
            crate::secrets::register(
                std::iter::once(credentials.secret_access_key().to_string())
                    .chain(credentials.session_token().map(str::to_string)),
            );
        }
    }
    if sdk.region().is_none() {
        return Err(Error::config(
            "no AWS region: neither the section's region, AWS_REGION nor the profile names one",
        )
        .remedy("set region = \"eu-west-1\" in the section (or AWS_REGION)"));
    }
    Ok(sdk)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_settles_entries_by_their_ids_and_one_it_does_not_mention_goes_again() {
        let refused = entry_failure("InvalidParameterValue", Some("bad attribute"), true);
        let lost = entry_failure("InternalError", None, false);
        // "3" both stored and failed: failed wins, so it is sent again rather than taken as
        // stored; "+3" and "03" are not ids outboxd gave.
        let got = outcomes(
            5,
            ["2", "0", "9", "x", "3", "+4", "04"].into_iter(),
            [("1".to_string(), refused), ("3".to_string(), lost)].into_iter(),
        );
        assert!(matches!(got[0], Outcome::Stored));
        assert!(
            matches!(&got[1], Outcome::Failed(f) if !f.transient && f.text == "InvalidParameterValue: bad attribute")
        );
        assert!(matches!(got[2], Outcome::Stored));
        assert!(matches!(&got[3], Outcome::Failed(f) if f.transient && f.code == "InternalError"));
        assert!(matches!(&got[4], Outcome::Failed(f) if f.transient && f.code == "NotInReply"));
    }
}
