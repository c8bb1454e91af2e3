//! The Kafka store: the checkpoint as a record in a compacted topic, so an instance needs no disk.
//!
//! The topic (`checkpoint.topic`, default `outboxd.checkpoints`) has one partition and
//! `cleanup.policy=compact`; outboxd creates it so when it is missing and refuses one shaped
//! otherwise (a deleting policy would drop a quiet pipeline's checkpoint after the retention time,
//! and the next start would silently begin anew). Record key = pipeline name, value = the same JSON
//! as the file store's; saved copies are keys `NAME/saved/LABEL` (names and labels never hold `/`),
//! a reset writes a tombstone.
//!
//! *Reading* takes the newest record of a key below the last stable offset, with
//! `isolation.level=read_committed`: it scans a window at the end of the partition and widens it
//! backwards until the key shows up (or the start is reached), so a start-up reads a few hundred
//! records even when compaction is days behind.
//!
//! *Writing* the live checkpoint goes through a transactional producer whose `transactional.id`
//! is derived from the pipeline name. [`KafkaStore::take_over`] (`init_transactions`) fences every
//! earlier holder of that id: an instance that lost the lead while frozen or cut off can no longer
//! commit a checkpoint, whatever it believes. That is what makes a standby safe (see
//! [`super::lease`]), and what `checkpoint set/reset` use to be the only writer for a moment.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{
    BaseRecord, DeliveryResult, FutureProducer, FutureRecord, Producer, ProducerContext,
    ThreadedProducer,
};
use rdkafka::{Offset, TopicPartitionList};

mod indexed;

use self::indexed::{index_group, Found};
use super::held::Held;
use super::store::{Backend, Slot};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::sink::kafka::fenced;
use crate::sink::kafka::index::{Indexed, RecordIndex, SendError};

/// The header naming the instance that wrote a live checkpoint (`host:pid`), for operators
/// reading the topic after a failover.
pub const INSTANCE_HEADER: &str = "outboxd.instance";

/// How long one read, write or metadata request may take before it is a (transient) error.
const TIMEOUT: Duration = Duration::from_secs(15);

/// A write stuck in librdkafka gets a new writer at once only while its deadline leaves one
/// `init_transactions` ([`TIMEOUT`]) and twice this margin, and a renewal begun [`TIMEOUT`] and this
/// margin after the takeover has settled the lead.
const REWRITE_MARGIN: Duration = Duration::from_secs(5);
/// The first window a read scans back from the end of the partition.
const FIRST_WINDOW: i64 = 256;
/// The checkpoint topic's `segment.ms`: the log cleaner never compacts the open segment, and
/// Kafka's default rolls it after 7 days, while every lead renewal and exactly-once commit adds a
/// record (and a transaction marker). An hour bounds what a read may have to scan.
const SEGMENT_MS: u64 = 3_600_000;
/// Above this `segment.ms`, `check` warns.
const SEGMENT_MS_WARN: u64 = 24 * 3_600_000;

pub struct KafkaStore {
    name: String,
    topic: String,
    /// `checkpoint.takeover_timeout_ms`: how fresh a lead renewal must be to count.
    takeover: Duration,
    /// Brokers and the security settings of `kafka.properties` (no producer tuning).
    base: ClientConfig,
    /// The transactional writer, while this instance may write the live checkpoint.
    writer: Mutex<Option<Arc<ThreadedProducer<Delivered>>>>,
    /// Opened for reading, and the topic does not exist: there is no checkpoint.
    missing: bool,
    /// Reads wait until transactions open below their high watermark are settled: set while this
    /// instance is the checkpoint writer (after [`KafkaStore::take_over`], which fenced the
    /// pipeline's own earlier writers and so settled their transactions). Other reads (`check`,
    /// `checkpoint show`, a standby's) do not wait: a killed instance's open transaction, which
    /// only the next leader's fencing settles, would hold them for its whole timeout.
    settle: std::sync::atomic::AtomicBool,
    /// The writers' `transaction.timeout.ms`: `kafka.properties`' when lower than 60 s (the
    /// brokers' `transaction.max.timeout.ms` may be), else 60 s. Never longer: a writer killed
    /// mid-commit holds the shared partition back for that long.
    transaction_timeout: Duration,
    /// Until when this instance may still hold the lead without another renewal: set when it
    /// takes over and by every renewal that commits. Writes retry passing failures until then.
    lead_until: Mutex<Instant>,
    /// When this instance last took the lead, and whether a renewal begun at least
    /// [`TIMEOUT`] + [`REWRITE_MARGIN`] after that has committed since: only then may a write stuck
    /// in librdkafka get a new writer at once. A takeover's own deadline rests on nothing another
    /// instance heard, and a second instance may have been taking over at the same moment; once
    /// such a renewal committed, any concurrent takeover either fenced it (so it failed) or came
    /// after a record every standby reads. Never set for `checkpoint` commands.
    taken: Mutex<(Option<Instant>, bool)>,
    /// Where committed-only reads last stopped below the written end, and since when: a
    /// transaction open longer than any of outboxd's may be is hanging ([`Held`]).
    held: Held,
    /// Where the live record is: committed with it, read before scanning (`indexed`).
    index: RecordIndex,
    /// The last read found the index naming a record the topic no longer holds.
    lost: std::sync::atomic::AtomicBool,
    /// How the last read found the live checkpoint.
    found: Mutex<Option<Found>>,
}

/// How long the final "released" record may take on SIGTERM (the pipeline waits 5 s for it).
const RELEASE_LIMIT: Duration = Duration::from_secs(4);

impl KafkaStore {
    /// Reaches the brokers and checks the checkpoint topic (compacted, one partition). With
    /// `create`, a missing topic is created; without (`check`, `checkpoint show`), it means
    /// "no checkpoint yet" and nothing is changed on the brokers.
    pub fn connect(config: &Config, name: &str, create: bool) -> Result<KafkaStore> {
        let kafka = config.kafka().ok_or_else(|| {
            Error::config("checkpoint.store = \"kafka\" needs the [kafka] section's brokers")
                .remedy("use checkpoint.store = \"file\" with this sink")
        })?;
        let mut base = ClientConfig::new();
        for (key, value) in &kafka.properties {
            if is_connection_property(key) {
                base.set(key, value);
            }
        }
        base.set("bootstrap.servers", &kafka.brokers)
            .set("client.id", format!("outboxd-{name}-checkpoint"));
        let topic = config.checkpoint.topic.clone();
        let group_name = index_group(name);
        let group: BaseConsumer<QuietContext> = base
            .clone()
            .set("group.id", &group_name)
            .create_with_context(QuietContext::default())
            .map_err(|e| unreachable(&topic, &e))?;
        let group = group.group_metadata().ok_or_else(|| {
            Error::checkpoint(
                "librdkafka gave no consumer group metadata for the checkpoint's index",
            )
        })?;
        let mut store = KafkaStore {
            name: name.to_string(),
            index: RecordIndex::new(&topic, &group_name, group),
            lost: std::sync::atomic::AtomicBool::new(false),
            found: Mutex::new(None),
            topic,
            takeover: Duration::from_millis(config.checkpoint.takeover_timeout_ms),
            base,
            writer: Mutex::new(None),
            missing: false,
            settle: std::sync::atomic::AtomicBool::new(false),
            transaction_timeout: crate::sink::kafka::KafkaSink::transaction_timeout(kafka)
                .min(crate::sink::kafka::DEFAULT_TRANSACTION_TIMEOUT),
            lead_until: Mutex::new(Instant::now()),
            taken: Mutex::new((None, false)),
            held: Held::new(crate::sink::kafka::KafkaSink::transaction_timeout(kafka)),
        };
        store.missing = !store.ensure_topic(create)?;
        Ok(store)
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The live checkpoint's key: the pipeline name.
    pub fn live_key(&self) -> String {
        self.name.clone()
    }

    /// The lead's key: who leads the pipeline, renewed while it does (see `lease`).
    pub fn lead_key(&self) -> String {
        format!("{}/lead", self.name)
    }

    /// A consumer that follows every record written to the topic, committed or not (for the
    /// lease: see [`Isolation::Written`]); with `committed`, only committed ones (the lease acts
    /// on a release once it is committed).
    pub fn tail_consumer(&self, committed: bool) -> Result<BaseConsumer<QuietContext>> {
        let isolation = if committed {
            Isolation::Committed
        } else {
            Isolation::Written
        };
        let mut config = self.base.clone();
        config
            .set("group.id", format!("outboxd.{}.lease", self.name))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("isolation.level", isolation.level());
        config
            .create_with_context(QuietContext::default())
            .map_err(|e| unreachable(&self.topic, &e))
    }

    fn transactional_id(&self) -> String {
        format!("outboxd.{}.checkpoint", self.name)
    }

    /// The transactional id of the pipeline's record producer (`kafka.exactly_once`). Apart from
    /// the checkpoint writer's: the lead renewals keep their own transactions, and each id fences
    /// its own earlier holders.
    pub fn records_transactional_id(&self) -> String {
        format!("outboxd.{}.records", self.name)
    }

    /// The index the live record's transaction commits its offset to.
    pub fn index(&self) -> RecordIndex {
        self.index.clone()
    }

    /// The live checkpoint `body` as a record (for a transaction of the record producer).
    pub fn live_record(&self, body: Vec<u8>) -> crate::route::Record {
        crate::route::Record {
            topic: self.topic.clone(),
            key: Some(self.live_key().into_bytes()),
            value: Some(body),
            headers: vec![(INSTANCE_HEADER.to_string(), Some(instance().into_bytes()))],
            timestamp: None,
            partition: Some(0),
        }
    }

    /// Whether the topic exists (after creating it, with `create`); an error when it has more
    /// than one partition or a policy that deletes records. CreateTopics is sent only for a topic
    /// the brokers do not know: under ACLs it needs CREATE even for an existing topic.
    fn ensure_topic(&self, create: bool) -> Result<bool> {
        let admin: AdminClient<DefaultClientContext> = self
            .base
            .create()
            .map_err(|e| unreachable(&self.topic, &e))?;
        let consumer = self.consumer(Isolation::Committed)?;
        let mut partitions = self.partitions(&consumer)?;
        if partitions == 0 {
            if !create {
                return Ok(false);
            }
            let brokers = consumer
                .fetch_metadata(Some(&self.topic), TIMEOUT)
                .map_err(|e| unreachable(&self.topic, &e))?
                .brokers()
                .len();
            self.create_topic(&admin, brokers)?;
            // A new topic reaches the metadata of every broker a moment after it is created.
            let deadline = Instant::now() + TIMEOUT;
            while partitions == 0 {
                if Instant::now() > deadline {
                    return Err(Error::checkpoint(format!(
                        "the checkpoint topic {} was created but the brokers list no partitions for it after {TIMEOUT:?}",
                        self.topic
                    ))
                    .remedy("outboxd retries; check the brokers")
                    .transient());
                }
                std::thread::sleep(Duration::from_millis(100));
                partitions = self.partitions(&consumer)?;
            }
        }
        if partitions != 1 {
            return Err(Error::config(format!(
                "checkpoint topic {} has {partitions} partitions; outboxd needs exactly one (a pipeline's checkpoints and lead are read in the order they were written)",
                self.topic
            ))
            .remedy("set checkpoint.topic to a new name (outboxd creates it), or recreate this one with --partitions 1 --config cleanup.policy=compact"));
        }
        self.check_policy(&admin)?;
        Ok(true)
    }

    /// The topic's partition count as the brokers tell it (0: no such topic).
    fn partitions(&self, consumer: &BaseConsumer<QuietContext>) -> Result<usize> {
        // Test builds: the brokers list the topic without partitions, as KRaft's metadata does
        // for a moment after CreateTopics returns (test
        // `a_new_checkpoint_topic_listed_without_partitions_for_a_moment_is_waited_for`).
        crate::fault_point!("checkpoint_topic_partitions_lag", |_| Ok(0));
        let metadata = consumer
            .fetch_metadata(Some(&self.topic), TIMEOUT)
            .map_err(|e| unreachable(&self.topic, &e))?;
        let Some(topic) = metadata.topics().iter().find(|t| t.name() == self.topic) else {
            return Ok(0);
        };
        match topic.error().map(RDKafkaErrorCode::from) {
            Some(RDKafkaErrorCode::TopicAuthorizationFailed) => Err(Error::checkpoint(format!(
                "the brokers refuse to describe the checkpoint topic {}: {}",
                self.topic,
                RDKafkaErrorCode::TopicAuthorizationFailed
            ))
            .remedy(format!(
                "grant outboxd's principal READ and WRITE on topic {} (docs/operations/high-availability.md)",
                self.topic
            ))),
            Some(RDKafkaErrorCode::InvalidTopic) => Err(Error::config(format!(
                "the brokers refuse the checkpoint topic's name {:?}",
                self.topic
            ))
            .remedy("set checkpoint.topic to a valid topic name (letters, digits, '.', '_' and '-', at most 249)")),
            // Missing (no partitions), or a passing state such as a leader being elected.
            _ => Ok(topic.partitions().len()),
        }
    }

    /// CreateTopics for the checkpoint topic: one partition, compacted, as durable as a cluster of
    /// `brokers` allows ([`Durability::for_cluster`]).
    fn create_topic(
        &self,
        admin: &AdminClient<DefaultClientContext>,
        brokers: usize,
    ) -> Result<()> {
        let durability = Durability::for_cluster(brokers);
        let min_insync = durability.min_insync.to_string();
        let segment_ms = SEGMENT_MS.to_string();
        // No broker listed (a metadata answer without them): the brokers' own default.
        let replicas = if brokers == 0 {
            -1
        } else {
            durability.replicas
        };
        let topic = NewTopic::new(&self.topic, 1, TopicReplication::Fixed(replicas))
            .set("cleanup.policy", "compact")
            .set("min.insync.replicas", &min_insync)
            .set("unclean.leader.election.enable", "false")
            .set("segment.ms", &segment_ms);
        let create = |topic: &NewTopic| {
            wait(admin.create_topics(
                [topic],
                &AdminOptions::new().operation_timeout(Some(TIMEOUT)),
            ))
            .map_err(|e| unreachable(&self.topic, &e))
        };
        let mut created = create(&topic)?;
        // A managed cluster's topic policy may refuse the settings (or the replica count): then
        // the brokers' defaults, and `check` says what the topic lacks.
        if created.iter().any(|r| {
            matches!(
                r,
                Err((
                    _,
                    RDKafkaErrorCode::PolicyViolation
                        | RDKafkaErrorCode::InvalidConfig
                        | RDKafkaErrorCode::InvalidReplicationFactor
                ))
            )
        }) {
            tracing::warn!(
                topic = self.topic,
                "the brokers refused the checkpoint topic's durability settings; creating it with their defaults (`outboxd check` says what it lacks)"
            );
            let plain = NewTopic::new(&self.topic, 1, TopicReplication::Fixed(-1))
                .set("cleanup.policy", "compact");
            created = create(&plain)?;
        }
        for result in created {
            match result {
                Ok(topic) => tracing::info!(
                    topic,
                    replicas = durability.replicas,
                    min_insync = durability.min_insync,
                    "created the checkpoint topic (compacted, one partition)"
                ),
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((topic, code)) => {
                    return Err(Error::checkpoint(format!(
                        "cannot create the checkpoint topic {topic}: {code}"
                    ))
                    .remedy(format!(
                        "create it yourself (kafka-topics.sh --create --topic {topic} --partitions 1 --replication-factor {} --config cleanup.policy=compact --config min.insync.replicas={} --config segment.ms={SEGMENT_MS}), or grant outboxd CREATE on it",
                        durability.replicas, durability.min_insync
                    )))
                }
            }
        }
        Ok(())
    }

    /// A topic that deletes old records would lose a quiet pipeline's checkpoint (and the next
    /// start would begin anew): refused when the brokers say so; a broker that cannot describe
    /// configs gets a warning.
    fn check_policy(&self, admin: &AdminClient<DefaultClientContext>) -> Result<()> {
        let policy = self
            .topic_configs(admin)
            .and_then(|c| c.get("cleanup.policy").cloned());
        match policy {
            Some(policy) if policy.trim() != "compact" => {
                return Err(Error::config(format!(
                    "checkpoint topic {} has cleanup.policy={policy}: a pipeline quiet for longer than its retention would lose its checkpoint and start anew",
                    self.topic
                ))
                .remedy(format!(
                    "set cleanup.policy=compact on it (kafka-configs.sh --alter --entity-type topics --entity-name {} --add-config cleanup.policy=compact), or point checkpoint.topic at a new name",
                    self.topic
                )))
            }
            Some(_) => {}
            None => tracing::warn!(
                topic = %self.topic,
                "the brokers did not say the checkpoint topic's cleanup.policy; make sure it is compact"
            ),
        }
        Ok(())
    }

    /// The topic's configuration as the brokers describe it (`None`: they would not say).
    fn topic_configs(
        &self,
        admin: &AdminClient<DefaultClientContext>,
    ) -> Option<std::collections::HashMap<String, String>> {
        use rdkafka::admin::ResourceSpecifier;
        let described = wait(admin.describe_configs(
            [&ResourceSpecifier::Topic(&self.topic)],
            &AdminOptions::new().request_timeout(Some(TIMEOUT)),
        ));
        let resource = described.ok()?.into_iter().next()?.ok()?;
        Some(
            resource
                .entries
                .into_iter()
                .filter_map(|e| Some((e.name, e.value?)))
                .collect(),
        )
    }

    /// `check`'s lines on how safely the topic keeps checkpoints: its replicas against the
    /// cluster's brokers, `min.insync.replicas`, unclean leader election and `segment.ms`. A
    /// checkpoint topic with one replica comes back empty when that broker loses its disk, and an
    /// empty topic reads as a first start.
    pub fn durability_items(&self) -> Vec<crate::preflight::Item> {
        use crate::preflight::Item;
        let subject = "checkpoint topic";
        let metadata = self
            .consumer(Isolation::Committed)
            .ok()
            .and_then(|consumer| consumer.fetch_metadata(Some(&self.topic), TIMEOUT).ok());
        let brokers = metadata.as_ref().map(|m| m.brokers().len());
        let facts = (|| {
            let admin: AdminClient<DefaultClientContext> = self.base.create().ok()?;
            let metadata = metadata.as_ref()?;
            let replicas = metadata
                .topics()
                .iter()
                .find(|t| t.name() == self.topic)?
                .partitions()
                .first()?
                .replicas()
                .len();
            Some((brokers?, replicas, self.topic_configs(&admin)?))
        })();
        if self.missing {
            let d = Durability::for_cluster(brokers.unwrap_or(1));
            return vec![Item::pass(
                subject,
                format!(
                    "{} does not exist yet; `run` creates it compacted with {} replica(s), min.insync.replicas {} and segment.ms {SEGMENT_MS}",
                    self.topic, d.replicas, d.min_insync
                ),
            )];
        }
        let Some((brokers, replicas, configs)) = facts else {
            return vec![Item::warn(
                subject,
                format!(
                    "the brokers did not describe {}'s replicas and settings",
                    self.topic
                ),
                "check that outboxd's principal has DESCRIBE_CONFIGS on the topic",
            )];
        };
        let number = |key: &str| configs.get(key).and_then(|v| v.trim().parse::<u64>().ok());
        let min_insync = number("min.insync.replicas").unwrap_or(1);
        let segment_ms = number("segment.ms");
        let unclean = configs
            .get("unclean.leader.election.enable")
            .map(|v| v.trim() == "true");
        let judged = Durability::judge(brokers, replicas, min_insync);
        let best = Durability::for_cluster(brokers);
        let mut items = Vec::new();
        let topic = &self.topic;
        match judged {
            Some(why) => items.push(Item::warn(
                subject,
                format!("{topic}: {why}"),
                format!(
                    "give it {} replicas and min.insync.replicas {} (kafka-reassign-partitions.sh for replicas; kafka-configs.sh --alter --entity-type topics --entity-name {topic} --add-config min.insync.replicas={}); docs/operations/high-availability.md",
                    best.replicas, best.min_insync, best.min_insync
                ),
            )),
            None => items.push(Item::pass(
                subject,
                format!(
                    "{topic}: {replicas} replica(s) on a cluster of {brokers} broker(s), min.insync.replicas {min_insync}"
                ),
            )),
        }
        if unclean == Some(true) {
            items.push(Item::warn(
                subject,
                format!("{topic} allows unclean leader election: a replica that fell behind may become leader and drop the newest checkpoints"),
                format!("kafka-configs.sh --alter --entity-type topics --entity-name {topic} --add-config unclean.leader.election.enable=false"),
            ));
        }
        if segment_ms.is_some_and(|ms| ms > SEGMENT_MS_WARN) {
            items.push(Item::warn(
                subject,
                format!(
                    "{topic} has segment.ms {}: compaction waits that long, so lead renewals and commits pile up and reads scan them",
                    segment_ms.unwrap_or_default()
                ),
                format!("kafka-configs.sh --alter --entity-type topics --entity-name {topic} --add-config segment.ms={SEGMENT_MS}"),
            ));
        }
        items
    }

    fn consumer(&self, isolation: Isolation) -> Result<BaseConsumer<QuietContext>> {
        let mut config = self.base.clone();
        config
            .set("group.id", self.index_group())
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true")
            // A scan ends at an empty fetch (the end of the partition): a transactional topic
            // ends with a commit marker, never delivered, so no record reaches `until` and every
            // scan would otherwise wait out librdkafka's 500 ms for that fetch (twice per start).
            .set("fetch.wait.max.ms", "10")
            // Scans read long runs of small records: bigger fetches, fewer round trips.
            .set("max.partition.fetch.bytes", "16777216")
            .set("isolation.level", isolation.level());
        config
            .create_with_context(QuietContext::default())
            .map_err(|e| unreachable(&self.topic, &e))
    }

    /// Reads the partition from `from` up to `until` (a high watermark asked before), key by key,
    /// committed records only. A read_committed reader's end is the last stable offset: a
    /// transaction left open below `until` (another pipeline's writer killed mid-commit, whose
    /// transaction the brokers abort after its timeout) would hide every newer record, so the scan
    /// waits until the end passes `until` rather than return an older checkpoint as the newest.
    fn scan(
        &self,
        isolation: Isolation,
        from: i64,
        until: i64,
        mut seen: impl FnMut(i64, &[u8], Option<&[u8]>),
    ) -> Result<()> {
        let consumer = self.consumer(isolation)?;
        let mut assignment = TopicPartitionList::new();
        assignment
            .add_partition_offset(&self.topic, 0, Offset::Offset(from))
            .and_then(|()| consumer.assign(&assignment))
            .map_err(|e| unreachable(&self.topic, &e))?;
        // A long scan may take longer in all (millions of records not compacted yet): the limit
        // is on time without progress.
        let mut deadline = Instant::now() + TIMEOUT;
        let mut told = false;
        // The read stopped below `until` (see `held` for how long, across reads).
        let mut held = false;
        loop {
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(message)) => {
                    deadline = Instant::now() + TIMEOUT;
                    seen(
                        message.offset(),
                        message.key().unwrap_or_default(),
                        message.payload(),
                    );
                    // A busy topic may never give an empty fetch (and so no end-of-partition
                    // event): past `until`, everything asked for was read.
                    if message.offset() + 1 >= until {
                        self.held.clear();
                        return Ok(());
                    }
                }
                Some(Err(KafkaError::PartitionEOF(_))) => {
                    let position = consumer.position().ok().and_then(|p| {
                        p.find_partition(&self.topic, 0)
                            .and_then(|p| p.offset().to_raw())
                    });
                    let settle = isolation == Isolation::Committed
                        && self.settle.load(std::sync::atomic::Ordering::Relaxed);
                    let Some(at) = position.filter(|&at| settle && at < until) else {
                        self.held.clear();
                        return Ok(());
                    };
                    held = true;
                    if !std::mem::replace(&mut told, true) {
                        self.tell_held(&consumer, at, until);
                    }
                }
                Some(Err(e)) if group_lookup_error(&e) => {}
                Some(Err(e)) => {
                    self.held.clear();
                    return Err(unreachable(&self.topic, &e));
                }
                None if Instant::now() > deadline => {
                    if let Some(stable) = held
                        .then(|| stable_offset(&consumer, &self.topic))
                        .flatten()
                    {
                        let held_for = self.held.observe(stable, Instant::now());
                        if self.held.hanging(held_for) {
                            return Err(self.held.hanging_error(
                                &self.topic,
                                stable,
                                until,
                                held_for,
                            ));
                        }
                    }
                    return Err(Error::checkpoint(format!(
                        "reading the checkpoint topic {} made no progress for {TIMEOUT:?}",
                        self.topic
                    ))
                    .remedy("outboxd retries; check the brokers (an open transaction on the topic holds readers back until it ends)")
                    .transient());
                }
                None => {}
            }
        }
    }

    /// A read waits at `at`, below `until`: counts how long readers have waited at that stable
    /// offset (across reads), and says so: INFO at first, ERROR once that is longer than any of
    /// outboxd's transactions may stay open (a hanging transaction: [`Held`]).
    fn tell_held(&self, consumer: &BaseConsumer<QuietContext>, at: i64, until: i64) {
        // Before its first record, librdkafka's position is no offset (-1001): ask where
        // committed-only reads end.
        let stable = stable_offset(consumer, &self.topic).unwrap_or(at);
        let now = Instant::now();
        let held_for = self.held.observe(stable, now);
        if !self.held.hanging(held_for) {
            tracing::info!(
                topic = self.topic,
                stable_until = stable,
                written_until = until,
                "waiting for a transaction open on the checkpoint topic to end before reading the checkpoint (another pipeline's, or one a killed instance left)"
            );
        } else if self.held.tell(now) {
            let e = self
                .held
                .hanging_error(&self.topic, stable, until, held_for);
            tracing::error!(error = %e, "the checkpoint topic holds a hanging transaction");
        }
    }

    /// The partition's low and high watermarks. Asked by a read_uncommitted client: a
    /// read_committed one is told the last stable offset instead, which an open transaction (a
    /// renewal in flight, or one a killed writer left for the next `init_transactions` to abort)
    /// holds back, and some brokers then report no records at all.
    fn watermarks(&self) -> Result<(i64, i64)> {
        let mut config = self.base.clone();
        config
            .set("group.id", self.index_group())
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_uncommitted");
        let consumer: BaseConsumer<QuietContext> = config
            .create_with_context(QuietContext::default())
            .map_err(|e| unreachable(&self.topic, &e))?;
        consumer
            .fetch_watermarks(&self.topic, 0, TIMEOUT)
            .map_err(|e| unreachable(&self.topic, &e))
    }

    /// The newest committed value of `key` (`None`: never written, or a tombstone).
    fn latest(&self, key: &str) -> Result<Option<Vec<u8>>> {
        if key == self.live_key() {
            return self.latest_live();
        }
        self.latest_as(Isolation::Committed, key)
    }

    /// The newest value of `key` as a reader with `isolation` sees it.
    fn latest_as(&self, isolation: Isolation, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.newest(isolation, key)?.and_then(|(_, value)| value))
    }

    /// The newest record of `key` as a reader with `isolation` sees it: its offset and value.
    fn newest(&self, isolation: Isolation, key: &str) -> Result<Option<(i64, Option<Vec<u8>>)>> {
        if self.missing {
            return Ok(None);
        }
        let (low, high) = self.watermarks()?;
        // Pages back from the end, each eight times the one before, each read once: the first
        // page (from the end) holding the key holds its newest value.
        let mut until = high;
        let mut window = FIRST_WINDOW;
        loop {
            let from = high.saturating_sub(window).max(low);
            let mut found: Option<(i64, Option<Vec<u8>>)> = None;
            if from < until {
                self.scan(isolation, from, until, |offset, k, v| {
                    if k == key.as_bytes() {
                        found = Some((offset, v.map(<[u8]>::to_vec)));
                    }
                })?;
            }
            if found.is_some() {
                return Ok(found);
            }
            if from <= low {
                return Ok(None);
            }
            until = from;
            window = window.saturating_mul(8);
        }
    }

    fn key(&self, slot: &Slot) -> String {
        match slot {
            Slot::Live => self.name.clone(),
            Slot::Saved(label) => format!("{}/saved/{label}", self.name),
        }
    }

    /// Makes this instance the pipeline's only checkpoint writer: `init_transactions` fences every
    /// earlier producer with the pipeline's transactional id (a frozen or cut-off old leader's
    /// commits fail from now on), and waits until their open transaction is settled.
    pub fn take_over(&self) -> Result<()> {
        let producer = self.fencing_producer(&self.transactional_id())?;
        *self.lead_until.lock().expect("lead deadline") = Instant::now() + self.takeover;
        *self.taken.lock().expect("taken") = (Some(Instant::now()), false);
        *self.writer.lock().expect("writer lock") = Some(Arc::new(producer));
        self.settle
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// `checkpoint set/reset/import-debezium`: the command fenced every writer and found no
    /// leader, and nothing renews a lead for it, so its writes get the store's own timeout rather
    /// than what is left of one takeover timeout (with a short `takeover_timeout_ms`, reading and
    /// saving the old checkpoint first could use that up before the write began).
    pub fn hold_for_command(&self) {
        *self.lead_until.lock().expect("lead deadline") = Instant::now() + 2 * TIMEOUT;
        *self.taken.lock().expect("taken") = (None, false);
    }

    /// Fences the pipeline's record producer too (`kafka.exactly_once`): a leader frozen with a
    /// transaction open can then no longer commit a checkpoint over the one `checkpoint set`
    /// writes. Harmless without exactly-once (the id is merely registered).
    pub fn fence_records(&self) -> Result<()> {
        self.fencing_producer(&self.records_transactional_id())
            .map(drop)
    }

    /// A transactional producer with `id`, after `init_transactions` fenced every earlier holder.
    fn fencing_producer(&self, id: &str) -> Result<ThreadedProducer<Delivered>> {
        self.fencing_producer_until(id, None)
    }

    /// [`KafkaStore::fencing_producer`]; with `resume_until` (a new writer in place of a stuck
    /// one), a retriable failure of `init_transactions` (the coordinator still loading after a
    /// broker restart) asks again on the same producer while another whole call still ends
    /// [`REWRITE_MARGIN`] before `resume_until`, as the first one did: the lead holds meanwhile.
    fn fencing_producer_until(
        &self,
        id: &str,
        resume_until: Option<Instant>,
    ) -> Result<ThreadedProducer<Delivered>> {
        let mut config = self.base.clone();
        config
            .set("transactional.id", id)
            .set(
                "transaction.timeout.ms",
                self.transaction_timeout.as_millis().to_string(),
            )
            .set("enable.idempotence", "true")
            .set("acks", "all");
        let producer: ThreadedProducer<Delivered> = config
            .create_with_context(Delivered::default())
            .map_err(|e| unreachable(&self.topic, &e))?;
        let mut asked = producer.init_transactions(TIMEOUT);
        let mut told = false;
        while let Err(KafkaError::Transaction(e)) = &asked {
            // A second between asks: a refusal may come back at once.
            let next = Instant::now() + Duration::from_secs(1);
            let room = resume_until.map(|until| until.saturating_duration_since(next));
            if !e.is_retriable() || room.is_none_or(|room| room <= TIMEOUT + REWRITE_MARGIN) {
                break;
            }
            if !std::mem::replace(&mut told, true) {
                tracing::warn!(error = %e, "the new checkpoint writer could not take its transactional id yet; asking again");
            }
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
            asked = producer.init_transactions(TIMEOUT);
        }
        asked.map_err(|e| {
            let error = Error::checkpoint(format!(
                "cannot become the checkpoint writer of pipeline {:?} (transactional id {id}): {e}",
                self.name,
            ));
            if e.rdkafka_error_code() == Some(RDKafkaErrorCode::InvalidTransactionTimeout) {
                error.remedy(format!(
                    "the brokers' transaction.max.timeout.ms is below the checkpoint writer's transaction.timeout.ms ({} ms): set kafka.properties.\"transaction.timeout.ms\" to at most the brokers' limit (and above twice kafka.transaction_interval_ms with exactly_once)",
                    self.transaction_timeout.as_millis()
                ))
            } else if refused_for_good(&e) {
                // Waiting cures neither a missing grant nor a broker without transactions.
                error.remedy(format!(
                    "grant outboxd's principal WRITE and DESCRIBE on the transactional id {id} (and, on brokers older than Kafka 3.0, IDEMPOTENT_WRITE on the cluster); a broker without transactions cannot keep outboxd's checkpoint: use checkpoint.store = \"file\" there"
                ))
            } else {
                error
                    .remedy("outboxd retries; check the brokers")
                    .transient()
            }
        })?;
        Ok(producer)
    }

    /// Gives up writing (the lead was lost): the producer closes without committing anything more.
    pub fn step_down(&self) {
        self.settle
            .store(false, std::sync::atomic::Ordering::Relaxed);
        *self.taken.lock().expect("taken") = (None, false);
        self.writer.lock().expect("writer lock").take();
    }

    /// One committed transaction holding one record (see [`Value`]). A passing refusal
    /// (a partition leader or transaction coordinator moving, too few replicas in sync for a
    /// moment, a commit that timed out) is retried with the same writer until `until` (when the
    /// lead lapses unless renewed: a leader that cannot write for that long may have been
    /// replaced) and within the transaction's own timeout; only then, or when fenced, or on an
    /// error no retry cures, is the lead given up.
    ///
    /// `until`: `None` for the lead's deadline as it stands once the writer is held (a write that
    /// waited for a retrying one finds the deadline that one's commit moved). `renews`: the
    /// record, once committed, renews a leader's lead like a renewal does (a live checkpoint or a
    /// renewal; not a release, and never a `checkpoint` command's write).
    fn commit(
        &self,
        key: &str,
        value: Value<'_>,
        until: Option<Instant>,
        renews: bool,
    ) -> Result<()> {
        let mut writer = self.writer.lock().expect("writer lock");
        if renews && key == self.lead_key() {
            crate::fault::renewal_held_once_released();
        }
        let Some(mut producer) = writer.clone() else {
            return Err(Error::checkpoint(format!(
                "this instance does not lead pipeline {:?}, so it writes no checkpoint",
                self.name
            ))
            .superseded());
        };
        let until = until.unwrap_or_else(|| self.lead_until());
        // When the open transaction began: no standby hears its record earlier.
        let begun = std::cell::Cell::new(Instant::now());
        // Also within the open transaction's own timeout (less a margin for the last attempt),
        // past which the brokers abort it themselves and fence this writer. A retry in a new
        // transaction (after an abort, or by a new writer in place of a stuck one) has its own.
        let deadline = || {
            until.min(
                begun.get()
                    + self
                        .transaction_timeout
                        .saturating_sub(Duration::from_secs(5)),
            )
        };
        // rdkafka flushes, then commits, each within the timeout given: half of what is left.
        let left = || {
            deadline()
                .saturating_duration_since(Instant::now())
                .min(TIMEOUT)
                / 2
        };
        let live = key == self.live_key();
        // The record is in an open transaction that a retried commit may still complete;
        // `indexed`: the index's entry joined it too (or a record of another key needs none).
        let mut open = false;
        let mut indexed = false;
        let mut retried = 0u32;
        // A write stuck in librdkafka gets at most one new writer (its coordinator is likely
        // still gone), and only on a settled lead (`taken`).
        let mut rewritable = self.taken.lock().expect("taken").1;
        let e = loop {
            let result = (|| {
                if !open {
                    begun.set(Instant::now());
                    producer.begin_transaction()?;
                    open = true;
                    indexed = !live;
                    *producer.context().offset.lock().expect("offset lock") = None;
                    let record = BaseRecord::<str, [u8]>::to(&self.topic).key(key).headers(
                        OwnedHeaders::new().insert(Header {
                            key: INSTANCE_HEADER,
                            value: Some(instance().as_str()),
                        }),
                    );
                    // A lead record says when this transaction began: a renewal that waited for
                    // the writer is heard no earlier, and an instance starting later judges the
                    // lead by it (`recent_leader`).
                    let lead;
                    let record = match value {
                        Value::Record(bytes) => record.payload(bytes),
                        Value::Tombstone => record,
                        Value::Lead { released } => {
                            lead = LeadRecord::now(released).body();
                            record.payload(lead.as_slice())
                        }
                    };
                    producer.send(record).map_err(|(e, _)| e)?;
                    if cfg!(feature = "failpoints")
                        && matches!(value, Value::Lead { released: true })
                    {
                        // A release that reached the log but is not committed yet (the test of
                        // a clean stop's handover: `release_commit_delayed=sleep(MS)`).
                        let _ = producer.flush(left());
                        crate::fault_point!("release_commit_delayed");
                    }
                }
                if !indexed {
                    self.index_live(
                        &producer,
                        matches!(value, Value::Tombstone),
                        &left,
                        retried == 0,
                    )?;
                    indexed = true;
                }
                Ok(producer.commit_transaction(left())?)
            })();
            let e = match result {
                Ok(()) => {
                    if retried > 0 {
                        tracing::info!(retried, "wrote to the checkpoint topic again");
                    }
                    if renews {
                        self.renewed(begun.get());
                    }
                    return Ok(());
                }
                Err(SendError::Kafka(e)) => e,
                Err(SendError::Stuck(what)) => {
                    // No abort: the producer's transactional API is still busy with the call. A
                    // new writer fences it (and aborts its transaction) while the lead is surely
                    // still held: its `init_transactions` ends well before the lead could lapse,
                    // so no standby can be taking over meanwhile. The lead stays where it is.
                    // Its write is a new transaction: only the lead bounds it.
                    let room = until.saturating_duration_since(Instant::now());
                    if rewritable && room > TIMEOUT + 2 * REWRITE_MARGIN {
                        rewritable = false;
                        tracing::warn!("{what}; a new writer takes its place and writes again");
                        let resume_until = until - REWRITE_MARGIN;
                        match self
                            .fencing_producer_until(&self.transactional_id(), Some(resume_until))
                        {
                            Ok(fresh) => {
                                producer = Arc::new(fresh);
                                *writer = Some(producer.clone());
                                open = false;
                                retried += 1;
                                continue;
                            }
                            Err(e) => {
                                writer.take();
                                return Err(e.superseded());
                            }
                        }
                    }
                    writer.take();
                    tracing::warn!("{what}; the checkpoint is written again by a new writer");
                    return Err(Error::checkpoint(format!(
                        "writing the checkpoint to topic {} got stuck in librdkafka: {what}",
                        self.topic
                    ))
                    .remedy("`run` takes the lead again with a new writer (which fences the stuck one) once its lead lapses, and resumes from the last committed checkpoint; a `checkpoint` command or `snapshot`: run it again. Repeated with every broker up: look at the broker that leads __consumer_offsets")
                    .superseded());
                }
            };
            if fenced(&e) || left() < Duration::from_millis(100) {
                break e;
            }
            match passing(&e) {
                Passing::No => break e,
                Passing::RetryCommit => {}
                Passing::AbortAndRetry => {
                    if producer.abort_transaction(left()).is_err() {
                        break e;
                    }
                    open = false;
                }
            }
            if retried == 0 {
                tracing::warn!(
                    error = %e,
                    "writing to the checkpoint topic failed for now; retrying until the lead would lapse (checkpoint.takeover_timeout_ms after the last renewal)"
                );
            }
            retried += 1;
            std::thread::sleep(Duration::from_millis(200));
        };
        let fenced = fenced(&e);
        // The writer is never reused after a failure: a new one comes only from `take_over`,
        // which the pipeline calls again only while it still holds the lead.
        if !fenced {
            let _ = producer.abort_transaction(Duration::from_secs(2));
        }
        writer.take();
        if group_lookup_error(&e) {
            return Err(self.group_grant_missing());
        }
        Err(if fenced {
            Error::checkpoint(format!(
                "another instance of pipeline {:?} took over the checkpoint (this one was fenced: {e})",
                self.name
            ))
            .remedy("nothing to do if you run a standby: this instance stands by. Otherwise another `outboxd run` (or `checkpoint set`) uses this pipeline's name")
            .superseded()
        } else {
            Error::checkpoint(format!(
                "writing the checkpoint to topic {} failed: {e}",
                self.topic
            ))
            .remedy("outboxd takes the lead again if it still holds it and resumes from the last committed checkpoint; check the brokers")
            .superseded()
        })
    }

    /// Adds the live record's index entry to the open transaction (flushed first, to learn where
    /// the record landed). The offset stays known until the next transaction begins: a retry after
    /// a failed `send_offsets_to_transaction` sends the same entry again. Each step gets its own
    /// share of the time left.
    fn index_live(
        &self,
        producer: &Arc<ThreadedProducer<Delivered>>,
        removed: bool,
        left: &dyn Fn() -> Duration,
        first_attempt: bool,
    ) -> std::result::Result<(), SendError> {
        producer.flush(left())?;
        let offset = *producer.context().offset.lock().expect("offset lock");
        // Flushed yet not acknowledged: the record failed. Never commit a live record without its
        // entry (the index would name an older checkpoint): the writer gives up instead.
        let offset = offset.ok_or(KafkaError::MessageProduction(RDKafkaErrorCode::Fail))?;
        // The coordinator not answering the first AddOffsetsToTxn of each write (test
        // `a_checkpoint_write_retried_after_its_index_failed_is_still_indexed`).
        if first_attempt {
            crate::fault_point!("checkpoint_index_send_fails", |_| Err(SendError::Kafka(
                KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut)
            )));
        }
        self.index
            .send(producer, Indexed { offset, removed }, left())
    }

    /// Renews the lead (see `lease`): fails, superseded, once another instance took over. It
    /// retries until the lead lapses ([`KafkaStore::lead_until`]).
    pub fn renew(&self) -> Result<()> {
        let started = Instant::now();
        self.commit(
            &self.lead_key(),
            Value::Lead { released: false },
            None,
            true,
        )?;
        let mut taken = self.taken.lock().expect("taken");
        if let (Some(at), false) = *taken {
            if started >= at + TIMEOUT + REWRITE_MARGIN {
                taken.1 = true;
                tracing::debug!(
                    "the lead is settled: a write stuck in librdkafka may get a new writer at once"
                );
            }
        }
        Ok(())
    }

    /// Says the lead is free (a clean stop), so a standby takes over without waiting out the timeout.
    pub fn release(&self) -> Result<()> {
        self.commit(
            &self.lead_key(),
            Value::Lead { released: true },
            Some(Instant::now() + RELEASE_LIMIT),
            false,
        )
    }

    /// When the lead lapses unless renewed: what a checkpoint write may wait for, and when the
    /// lease gives the lead up.
    pub fn lead_until(&self) -> Instant {
        *self.lead_until.lock().expect("lead deadline")
    }

    /// A leader's renewal or live checkpoint committed, its transaction begun at `begun`: every
    /// standby hears it then or later, so none takes over before `begun` + the takeover timeout.
    /// A checkpoint write counts like a renewal, so a write that retried long (holding the writer,
    /// so no renewal could commit meanwhile) leaves the lead its full time once it lands.
    fn renewed(&self, begun: Instant) {
        if self.taken.lock().expect("taken").0.is_none() {
            return;
        }
        let mut until = self.lead_until.lock().expect("lead deadline");
        *until = (*until).max(begun + self.takeover);
    }

    /// A saved copy: a plain (idempotent, acks=all) write, so saving never fences a running lead.
    fn save(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut config = self.base.clone();
        config
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", TIMEOUT.as_millis().to_string());
        let producer: FutureProducer = config.create().map_err(|e| unreachable(&self.topic, &e))?;
        let record = FutureRecord::to(&self.topic).key(key).payload(value);
        wait(producer.send(record, TIMEOUT))
            .map(|_| ())
            .map_err(|(e, _)| unreachable(&self.topic, &e))
    }

    /// The newest lead record written (committed or not, [`Isolation::Written`]): its offset, the
    /// record, and whether it frees the lead (a release, once committed: a standby that acted on
    /// a release still open would fence the stopping leader's commit of it).
    fn newest_lead(&self) -> Result<Option<(i64, LeadRecord, bool)>> {
        let Some((offset, record)) = self
            .newest(Isolation::Written, &self.lead_key())?
            .and_then(|(offset, body)| Some((offset, LeadRecord::parse(body.as_deref())?)))
        else {
            return Ok(None);
        };
        let free = record.released
            && self
                .newest(Isolation::Committed, &self.lead_key())?
                .is_some_and(|(committed, _)| committed == offset);
        Ok(Some((offset, record, free)))
    }

    /// The newest lead record, if it says an instance led within twice the takeover timeout (the
    /// clocks of two machines: a margin of one more timeout) and has not released the lead (a
    /// release still open counts as a lead: it may yet abort).
    fn recent_leader(&self) -> Result<Option<(LeadRecord, i64)>> {
        let Some((_, record, free)) = self.newest_lead()? else {
            return Ok(None);
        };
        Ok(self.led_lately(&record, free).map(|age| (record, age)))
    }

    /// How long ago `record` was renewed, if that is recent enough to count as a live lead.
    fn led_lately(&self, record: &LeadRecord, free: bool) -> Option<i64> {
        let age = chrono::Utc::now().timestamp_millis() - record.renewed_at_ms;
        (!free && age < 2 * self.takeover.as_millis() as i64).then_some(age)
    }

    /// Whether no instance has led lately (a starting instance need not wait out the takeover
    /// timeout), and the newest lead record's offset and whether it is a release (the lease
    /// starts from it: see `lease`).
    pub fn lead_at_start(&self) -> Result<(bool, Option<(i64, bool)>)> {
        let Some((offset, record, free)) = self.newest_lead()? else {
            return Ok((true, None));
        };
        let free = self.led_lately(&record, free).is_none();
        Ok((free, Some((offset, record.released))))
    }

    /// Refuses while an instance leads the pipeline (a lead renewed lately), as the file store's
    /// lock does.
    pub fn ensure_no_leader(&self) -> Result<()> {
        if let Some((record, age)) = self.recent_leader()? {
            if record.released {
                return Err(Error::checkpoint(format!(
                    "pipeline {:?} is stopping: {} released its lead, but the release is not committed yet",
                    self.name, record.instance,
                ))
                .remedy("run the command again in a moment (a release that never commits counts as a lead until twice checkpoint.takeover_timeout_ms after it)"));
            }
            return Err(Error::checkpoint(format!(
                "pipeline {:?} is running: {} renewed its lead {:.1} s ago",
                self.name,
                record.instance,
                age.max(0) as f64 / 1000.0
            ))
            .remedy("stop every `outboxd run` of this pipeline first (a stopped one releases the lead at once; a killed one after twice checkpoint.takeover_timeout_ms)"));
        }
        Ok(())
    }
}

impl Backend for std::sync::Arc<KafkaStore> {
    fn where_live(&self) -> String {
        format!("Kafka topic {} key {:?}", self.topic, self.name)
    }

    fn where_saved(&self) -> String {
        format!("Kafka topic {} keys \"{}/saved/…\"", self.topic, self.name)
    }

    fn read(&self, slot: &Slot) -> Result<Option<Vec<u8>>> {
        self.latest(&self.key(slot))
    }

    fn write(&self, slot: &Slot, body: &[u8]) -> Result<()> {
        match slot {
            Slot::Live => self.commit(&self.key(slot), Value::Record(body), None, true),
            Slot::Saved(_) => self.save(&self.key(slot), body),
        }
    }

    fn remove(&self, slot: &Slot) -> Result<()> {
        self.commit(&self.key(slot), Value::Tombstone, None, false)
    }

    fn saved_labels(&self) -> Result<Vec<String>> {
        if self.missing {
            return Ok(Vec::new());
        }
        let prefix = format!("{}/saved/", self.name);
        let (low, high) = self.watermarks()?;
        let mut labels = std::collections::BTreeMap::new();
        self.scan(Isolation::Committed, low, high, |_, key, value| {
            if let Some(label) = std::str::from_utf8(key)
                .ok()
                .and_then(|k| k.strip_prefix(&prefix))
            {
                labels.insert(label.to_string(), value.is_some());
            }
        })?;
        Ok(labels
            .into_iter()
            .filter_map(|(label, present)| present.then_some(label))
            .collect())
    }
}

/// How many copies of the checkpoint topic a cluster can keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Durability {
    replicas: i32,
    min_insync: u64,
}

impl Durability {
    /// Three replicas where the cluster has three brokers (fewer on smaller ones), and a write
    /// acknowledged by two of them where there are three: one broker's lost disk then loses no
    /// checkpoint, and one broker down still lets checkpoints be written.
    fn for_cluster(brokers: usize) -> Durability {
        let replicas = brokers.clamp(1, 3) as i32;
        Durability {
            replicas,
            min_insync: if replicas >= 3 { 2 } else { 1 },
        }
    }

    /// Why a topic with `replicas` and `min_insync` on `brokers` keeps checkpoints less safely
    /// than it could (`None`: as safely as this cluster allows).
    fn judge(brokers: usize, replicas: usize, min_insync: u64) -> Option<String> {
        let best = Durability::for_cluster(brokers);
        if (replicas as i32) < best.replicas {
            return Some(format!(
                "{replicas} replica(s) on a cluster of {brokers} brokers: one broker's lost disk loses every pipeline's checkpoint, and the next start would begin anew"
            ));
        }
        if min_insync > replicas as u64 {
            return Some(format!(
                "min.insync.replicas {min_insync} with {replicas} replica(s): no checkpoint can ever be written"
            ));
        }
        if replicas >= 2 && min_insync >= replicas as u64 {
            return Some(format!(
                "min.insync.replicas {min_insync} with {replicas} replicas: one broker down or restarting stops every checkpoint write, and every pipeline loses its lead"
            ));
        }
        if replicas >= 3 && min_insync < 2 {
            return Some(format!(
                "min.insync.replicas {min_insync}: a checkpoint is acknowledged once one broker has it, and that broker's lost disk loses it"
            ));
        }
        None
    }
}

/// Which records of the topic a reader sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isolation {
    /// Committed records only (`read_committed`), below the last stable offset: checkpoints. A
    /// checkpoint of a transaction that may still abort must never be resumed from.
    Committed,
    /// Every record written (`read_uncommitted`): who leads. All pipelines share the topic's one
    /// partition, and another pipeline's open transaction (a writer killed mid-commit stays open
    /// for its `transaction.timeout.ms`) holds the last stable offset back: a committed-only
    /// reader would hear no renewal of a healthy leader behind it and take over. A renewal that
    /// reached the log proves its writer was alive when it wrote it, committed or not; a fenced
    /// writer's renewals never reach the log. One that keeps failing to commit is heard until it
    /// gives the lead up itself, after one takeover timeout.
    Written,
}

impl Isolation {
    fn level(self) -> &'static str {
        match self {
            Isolation::Committed => "read_committed",
            Isolation::Written => "read_uncommitted",
        }
    }
}

/// What one checkpoint-topic transaction writes under its key.
#[derive(Clone, Copy)]
enum Value<'a> {
    Record(&'a [u8]),
    /// `checkpoint reset`.
    Tombstone,
    /// A [`LeadRecord`] stamped when its transaction begins (not when the write was asked for).
    Lead {
        released: bool,
    },
}

/// The lead record's value (key `NAME/lead`).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct LeadRecord {
    pub instance: String,
    pub renewed_at_ms: i64,
    /// Written by a leader that stops cleanly.
    #[serde(default)]
    pub released: bool,
}

impl LeadRecord {
    fn now(released: bool) -> LeadRecord {
        LeadRecord {
            instance: instance(),
            renewed_at_ms: chrono::Utc::now().timestamp_millis(),
            released,
        }
    }

    fn body(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("lead record serializes")
    }

    pub fn parse(body: Option<&[u8]>) -> Option<LeadRecord> {
        serde_json::from_slice(body?).ok()
    }
}

/// Client callbacks that keep librdkafka's expected events (end of partition) out of the error log,
/// and its repeats: while a broker is down librdkafka reports every failed connection attempt
/// (about ten a second), so each client warns about each kind of error at most once per
/// [`RETELL`], with how many it held back (the rest go to debug).
#[derive(Default)]
pub struct QuietContext {
    /// Per kind of error, so that a new one (a refused login after a broker outage) still shows.
    retell: Mutex<std::collections::HashMap<String, Retell>>,
}

/// How often a checkpoint topic client warns about librdkafka errors.
const RETELL: Duration = Duration::from_secs(30);

/// At most one warning per [`RETELL`], counting the ones held back.
#[derive(Default)]
struct Retell {
    last: Option<Instant>,
    held_back: u64,
}

impl Retell {
    /// `Some(held back since the last one)` when a warning is due at `now`.
    fn due(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.duration_since(last) < RETELL => {
                self.held_back += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.held_back))
            }
        }
    }
}

impl rdkafka::ClientContext for QuietContext {
    fn error(&self, error: KafkaError, reason: &str) {
        // librdkafka reports the end of a partition as an error event too, either as such or
        // wrapped as a "global" error.
        if matches!(
            error,
            KafkaError::PartitionEOF(_) | KafkaError::Global(RDKafkaErrorCode::PartitionEOF)
        ) {
            return;
        }
        if group_lookup_error(&error) {
            tracing::debug!(%error, reason, "checkpoint topic client (its group is never joined)");
            return;
        }
        let kind = format!("{:?}", error.rdkafka_error_code());
        let due = self
            .retell
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(kind)
            .or_default()
            .due(Instant::now());
        match due {
            Some(held_back) => {
                tracing::warn!(%error, reason, held_back, "checkpoint topic client (at most one warning per kind of error per 30 s; held_back: repeats since the last one)")
            }
            None => tracing::debug!(%error, reason, "checkpoint topic client"),
        }
    }
}

impl rdkafka::consumer::ConsumerContext for QuietContext {}

/// The checkpoint writer's context: where its last record landed (the index's entry).
#[derive(Default)]
pub struct Delivered {
    offset: Mutex<Option<i64>>,
}

impl rdkafka::ClientContext for Delivered {}

impl ProducerContext for Delivered {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if let Ok(message) = result {
            *self.offset.lock().expect("offset lock") = Some(message.offset());
        }
    }
}

/// Where a committed-only reader of the partition stops: the last stable offset (a
/// `read_committed` consumer's high watermark), `None` when the brokers do not answer in time.
fn stable_offset(consumer: &BaseConsumer<QuietContext>, topic: &str) -> Option<i64> {
    consumer
        .fetch_watermarks(topic, 0, Duration::from_secs(5))
        .ok()
        .map(|(_, stable)| stable)
}

/// The readers name a consumer group (librdkafka's `assign` needs one) but never join it or commit
/// to it, yet librdkafka looks its coordinator up: without DESCRIBE on the group that lookup fails,
/// and the failure says nothing about the reads, which need no grant on the group.
fn group_lookup_error(e: &KafkaError) -> bool {
    e.rdkafka_error_code() == Some(RDKafkaErrorCode::GroupAuthorizationFailed)
}

/// What a failed transactional write allows (librdkafka's own classification).
#[derive(Debug, PartialEq, Eq)]
enum Passing {
    /// Fatal, or not a transactional error: the writer is done.
    No,
    /// The commit may be asked for again (it timed out, or the brokers said "retry").
    RetryCommit,
    /// The transaction must be aborted, then the record sent again in a new one.
    AbortAndRetry,
}

fn passing(e: &KafkaError) -> Passing {
    if group_lookup_error(e) {
        return Passing::No;
    }
    match e {
        // rdkafka flushes before it asks librdkafka to commit; a flush that timed out leaves the
        // transaction open and committable.
        KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut) => Passing::RetryCommit,
        KafkaError::Transaction(e) if e.is_fatal() => Passing::No,
        // Refusals librdkafka reports as abortable that no retry cures.
        KafkaError::Transaction(e)
            if matches!(
                e.code(),
                RDKafkaErrorCode::TopicAuthorizationFailed
                    | RDKafkaErrorCode::TransactionalIdAuthorizationFailed
                    | RDKafkaErrorCode::ClusterAuthorizationFailed
                    | RDKafkaErrorCode::InvalidRecord
                    | RDKafkaErrorCode::MessageSizeTooLarge
                    | RDKafkaErrorCode::InvalidTransactionTimeout
            ) =>
        {
            Passing::No
        }
        KafkaError::Transaction(e) if e.txn_requires_abort() => Passing::AbortAndRetry,
        KafkaError::Transaction(e) if e.is_retriable() => Passing::RetryCommit,
        _ => Passing::No,
    }
}

/// Errors of `init_transactions` that no retry cures: no grant, or no transactions at all.
fn refused_for_good(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::TransactionalIdAuthorizationFailed
                | RDKafkaErrorCode::ClusterAuthorizationFailed
                | RDKafkaErrorCode::UnsupportedVersion
                | RDKafkaErrorCode::UnsupportedForMessageFormat
                | RDKafkaErrorCode::InvalidTransactionTimeout
                | RDKafkaErrorCode::UnsupportedFeature
        )
    )
}

/// This process, as `host:pid`.
fn instance() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into());
    format!("{host}:{}", std::process::id())
}

/// Settings every connection needs (where and how to connect), as opposed to producer tuning.
pub(crate) fn is_connection_property(key: &str) -> bool {
    [
        "security.",
        "ssl.",
        "sasl.",
        "socket.",
        "broker.",
        "client.dns.",
    ]
    .iter()
    .any(|prefix| key.starts_with(prefix))
        || matches!(
            key,
            "api.version.request" | "reconnect.backoff.ms" | "reconnect.backoff.max.ms"
        )
}

fn unreachable(topic: &str, e: &KafkaError) -> Error {
    Error::checkpoint(format!("checkpoint topic {topic}: {e}"))
        .remedy(
            "outboxd retries; check kafka.brokers and the security settings in kafka.properties",
        )
        .transient()
}

/// Runs an rdkafka future (completed by librdkafka's own threads) to its end from sync code, also
/// from inside the async runtime (on a thread of its own).
fn wait<F: Future + Send>(future: F) -> F::Output
where
    F::Output: Send,
{
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a current-thread runtime")
                    .block_on(future)
            })
            .join()
            .expect("the rdkafka future's thread")
    })
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_client_warns_once_per_thirty_seconds_and_counts_what_it_held_back() {
        let mut retell = Retell::default();
        let start = Instant::now();
        assert_eq!(retell.due(start), Some(0));
        assert_eq!(retell.due(start + Duration::from_millis(100)), None);
        assert_eq!(retell.due(start + Duration::from_secs(29)), None);
        assert_eq!(retell.due(start + RETELL), Some(2));
        assert_eq!(retell.due(start + RETELL + Duration::from_secs(1)), None);
    }

    use super::*;

    #[test]
    fn the_checkpoint_topic_is_as_durable_as_the_cluster_allows() {
        let d = Durability::for_cluster;
        assert_eq!(
            d(1),
            Durability {
                replicas: 1,
                min_insync: 1
            }
        );
        assert_eq!(
            d(2),
            Durability {
                replicas: 2,
                min_insync: 1
            }
        );
        assert_eq!(
            d(3),
            Durability {
                replicas: 3,
                min_insync: 2
            }
        );
        assert_eq!(
            d(9),
            Durability {
                replicas: 3,
                min_insync: 2
            }
        );
        assert!(Durability::judge(1, 1, 1).is_none());
        assert!(Durability::judge(5, 1, 1)
            .unwrap()
            .contains("1 replica(s) on a cluster of 5"));
        assert!(Durability::judge(3, 3, 1)
            .unwrap()
            .contains("min.insync.replicas 1"));
        assert!(Durability::judge(3, 3, 2).is_none());
        assert!(Durability::judge(2, 2, 1).is_none());
        assert!(Durability::judge(3, 3, 3)
            .unwrap()
            .contains("one broker down"));
        assert!(Durability::judge(1, 1, 2)
            .unwrap()
            .contains("no checkpoint can ever"));
    }

    #[test]
    fn only_connection_settings_reach_the_store() {
        assert!(is_connection_property("security.protocol"));
        assert!(is_connection_property("ssl.ca.location"));
        assert!(is_connection_property("sasl.password"));
        assert!(!is_connection_property("linger.ms"));
        assert!(!is_connection_property("compression.type"));
    }
}
