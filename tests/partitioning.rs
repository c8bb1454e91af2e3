//! Keyed records land where Kafka's Java producer would put them (murmur2), so a cutover from
//! Debezium (or any Java producer) onto existing multi-partition topics keeps each key's order.

use crate::rig::kafka::{check_java_partitions, java_murmur2, java_partition};
use crate::rig::scenario::{config_body, consume_events, SCHEMA};
use crate::rig::{create_topic, Broker, MariaDb, Outboxd};

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
    let db = MariaDb::start(&[]);
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
