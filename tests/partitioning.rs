//! Keyed records land where Kafka's Java producer would put them (murmur2), so a cutover from
//! Debezium (or any Java producer) onto existing multi-partition topics keeps each key's order.

use std::collections::{BTreeMap, BTreeSet};

use crate::rig::kafka::{check_java_partitions, java_murmur2, java_partition, java_produce};
use crate::rig::scenario::{config_body, consume_events, LIMIT, SCHEMA};
use crate::rig::{consume, create_topic, Broker, Mysqld, Outboxd};

#[test]
fn the_test_murmur2_matches_the_java_clients_own_vectors() {
    // org.apache.kafka.common.utils.UtilsTest#testMurmur2
    for (key, hash) in [
        (&b"21"[..], -973932308),
        (b"foobar", -790332482),
        (b"a-little-bit-long-string", -985981536),
        (b"a-little-bit-longer-string", -1486304829),
        (
            b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
            -58897971,
        ),
        (b"abc", 479470107),
    ] {
        assert_eq!(java_murmur2(key), hash, "{}", String::from_utf8_lossy(key));
    }
}

#[test]
fn keyed_records_land_on_the_java_clients_murmur2_partition_of_a_six_partition_topic() {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 6);
    }
    let mut outboxd = Outboxd::new(
        "murmur2",
        &config_body(&db.cdc_url(), &broker.bootstrap(), "", ""),
    );
    outboxd.start();
    // The session's clock is what the binlog records for its transactions: the record timestamp
    // must be that commit time, not the time outboxd produced the record.
    db.sql_socket(&format!(
        "SET timestamp = 1700000000;\n{}",
        crate::rig::scenario::transactions(0, 300, 10, crate::rig::scenario::insert_sql)
    ));
    let records = consume_events(&broker.bootstrap(), 300);
    assert_eq!(records.len(), 300);
    check_java_partitions(&records, 6);
    assert!(records
        .iter()
        .all(|r| r.timestamp == Some(1_700_000_000_000)));
    // The keys (key-0 .. key-16) are spread, and librdkafka's old default (CRC32) would have put
    // some of them elsewhere: this test tells the two apart.
    let used: std::collections::BTreeSet<i32> = records.iter().map(|r| r.partition).collect();
    assert!(used.len() > 3, "partitions used: {used:?}");
    let crc_differs = (0..17).any(|k| {
        let key = format!("key-{k}");
        (crc32fast::hash(key.as_bytes()) % 6) as i32 != java_partition(key.as_bytes(), 6)
    });
    assert!(crc_differs);
    outboxd.stop();
}

/// 1,000 keys: the empty key, ASCII, UTF-8 (accents, CJK, emoji) and long ones (up to the
/// column's 255 characters).
fn thousand_keys() -> Vec<String> {
    let mut keys = vec![String::new()];
    keys.extend((1..1000).map(|n| match n % 4 {
        0 => format!("order-{n}"),
        1 => format!("Zürich-ß-東京-🎉-{n}"),
        2 => format!("{}{n}", "long-key-".repeat(10 + n % 17)),
        _ => n.to_string(),
    }));
    keys
}

#[test]
fn a_thousand_keys_land_on_the_partitions_kafkas_java_producer_picks_on_six_and_seven_partitions() {
    let keys = thousand_keys();
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let broker = Broker::start();
    let bootstrap = broker.bootstrap();
    for partitions in [6, 7] {
        create_topic(
            &bootstrap,
            &format!("outbox.event.p{partitions}"),
            partitions,
        );
        create_topic(&bootstrap, &format!("java.p{partitions}"), partitions);
    }
    let mut outboxd = Outboxd::new(
        "java-partitions",
        &config_body(&db.cdc_url(), &bootstrap, "", ""),
    );
    outboxd.start();
    let mut script = String::new();
    for (n, key) in keys.iter().enumerate() {
        for partitions in [6, 7] {
            script.push_str(&format!(
                "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) \
                 VALUES (UNHEX('{partitions}{n:031x}'), 'p{partitions}', '{key}', 'Created', '{{}}');\n"
            ));
        }
    }
    db.sql_socket(&script);
    for partitions in [6, 7] {
        let java: Vec<(String, String)> = keys
            .iter()
            .enumerate()
            .map(|(n, k)| (k.clone(), n.to_string()))
            .collect();
        java_produce(&bootstrap, &format!("java.p{partitions}"), &java);
        let by_java: BTreeMap<Vec<u8>, i32> = consume(
            &bootstrap,
            &format!("java.p{partitions}"),
            keys.len(),
            LIMIT,
        )
        .into_iter()
        .map(|r| (r.key.expect("the console producer's key"), r.partition))
        .collect();
        let ours = consume(
            &bootstrap,
            &format!("outbox.event.p{partitions}"),
            keys.len(),
            LIMIT,
        );
        assert_eq!((by_java.len(), ours.len()), (keys.len(), keys.len()));
        let mut used = BTreeSet::new();
        for r in &ours {
            let key = r.key.clone().expect("every outbox record is keyed");
            assert_eq!(
                Some(&r.partition),
                by_java.get(&key),
                "key {:?} on {} partitions: outboxd and the Java producer disagree",
                String::from_utf8_lossy(&key),
                partitions
            );
            used.insert(r.partition);
        }
        assert_eq!(used.len(), partitions as usize, "every partition is hit");
    }
    outboxd.stop();
}
