//! Raw binlog event type codes the decoder acts on, including MariaDB's own (>= 160), which the
//! generic event parser does not know.

pub const QUERY: u8 = 2;
pub const ROTATE: u8 = 4;
pub const FORMAT_DESCRIPTION: u8 = 15;
pub const XID: u8 = 16;
pub const TABLE_MAP: u8 = 19;
pub const WRITE_ROWS_V1: u8 = 23;
pub const UPDATE_ROWS_V1: u8 = 24;
pub const DELETE_ROWS_V1: u8 = 25;
pub const HEARTBEAT: u8 = 27;
pub const WRITE_ROWS: u8 = 30;
pub const UPDATE_ROWS: u8 = 31;
pub const DELETE_ROWS: u8 = 32;
pub const GTID: u8 = 33;
pub const ANONYMOUS_GTID: u8 = 34;
pub const PREVIOUS_GTIDS: u8 = 35;
pub const XA_PREPARE: u8 = 38;
pub const PARTIAL_UPDATE_ROWS: u8 = 39;
pub const TRANSACTION_PAYLOAD: u8 = 40;
pub const GTID_TAGGED: u8 = 42;

pub const MARIADB_GTID: u8 = 162;
pub const MARIADB_GTID_LIST: u8 = 163;
pub const MARIADB_QUERY_COMPRESSED: u8 = 165;
/// MariaDB compressed row events (`log_bin_compress=ON`): write/update/delete, v1 and v2.
pub const MARIADB_COMPRESSED_ROWS: std::ops::RangeInclusive<u8> = 166..=171;

/// Every event type that carries row images.
pub fn is_rows_event(t: u8) -> bool {
    matches!(
        t,
        WRITE_ROWS_V1
            | UPDATE_ROWS_V1
            | DELETE_ROWS_V1
            | WRITE_ROWS
            | UPDATE_ROWS
            | DELETE_ROWS
            | PARTIAL_UPDATE_ROWS
    ) || MARIADB_COMPRESSED_ROWS.contains(&t)
}

/// MariaDB GTID event (type 162) body: `seq_no u64, domain_id u32, flags2 u8, …`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MariaGtid {
    pub domain: u32,
    pub seq: u64,
    /// FL_STANDALONE: a single statement (DDL) with no BEGIN/COMMIT around it.
    pub standalone: bool,
    /// FL_PREPARED_XA: the group is an XA transaction's prepare (`XA START … XA PREPARE`); its rows
    /// are not committed yet.
    pub prepared_xa: bool,
}

impl MariaGtid {
    pub fn parse(data: &[u8]) -> Option<MariaGtid> {
        let seq = u64::from_le_bytes(data.get(0..8)?.try_into().ok()?);
        let domain = u32::from_le_bytes(data.get(8..12)?.try_into().ok()?);
        let flags = *data.get(12)?;
        Some(MariaGtid {
            domain,
            seq,
            standalone: flags & 1 != 0,
            prepared_xa: flags & 0x40 != 0,
        })
    }
}

/// An XA_PREPARE event (type 38) body: `one_phase u8, format_id i32, gtrid_len u32, bqual_len u32`,
/// then the gtrid and bqual bytes. Returns whether it commits at once (`XA COMMIT … ONE PHASE`) and
/// the xid in the form the server writes in `XA COMMIT`/`XA ROLLBACK` statements (see [`xid_key`]).
pub fn parse_xa_prepare(data: &[u8]) -> Option<(bool, String)> {
    let one_phase = *data.first()? != 0;
    // Unsigned, as the server prints it in `XA COMMIT` (MySQL allows the full 32 bits).
    let format_id = u32::from_le_bytes(data.get(1..5)?.try_into().ok()?);
    let gtrid = u32::from_le_bytes(data.get(5..9)?.try_into().ok()?) as usize;
    let bqual = u32::from_le_bytes(data.get(9..13)?.try_into().ok()?) as usize;
    let bytes = data.get(13..13usize.checked_add(gtrid)?.checked_add(bqual)?)?;
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    Some((
        one_phase,
        format!(
            "x'{}',x'{}',{format_id}",
            hex(&bytes[..gtrid]),
            hex(&bytes[gtrid..])
        ),
    ))
}

/// The xid of an `XA COMMIT`/`XA ROLLBACK` statement as the server logs it (`X'6131',X'',1`),
/// normalised (lower case, no blanks) so it compares equal to [`parse_xa_prepare`]'s.
pub fn xid_key(text: &str) -> String {
    text.chars()
        .filter(|c| !c.is_whitespace())
        .flat_map(char::to_lowercase)
        .collect()
}

/// MariaDB GTID_LIST event (type 163) body: `count u32` (low 28 bits), then `count` times
/// `domain u32, server u32, seq u64`. `None` if malformed.
pub fn parse_gtid_list(data: &[u8]) -> Option<super::position::MariaGtidState> {
    let count = u32::from_le_bytes(data.get(0..4)?.try_into().ok()?) & 0x0fff_ffff;
    let mut state = super::position::MariaGtidState::default();
    for i in 0..count as usize {
        let at = 4 + i * 16;
        let entry = data.get(at..at + 16)?;
        let domain = u32::from_le_bytes(entry[0..4].try_into().ok()?);
        let server = u32::from_le_bytes(entry[4..8].try_into().ok()?);
        let seq = u64::from_le_bytes(entry[8..16].try_into().ok()?);
        state.apply(domain, server, seq);
    }
    Some(state)
}

/// The table id at the start of a rows event's post-header (6 bytes, little endian).
pub fn rows_event_table_id(data: &[u8]) -> Option<u64> {
    let raw = data.get(0..6)?;
    let mut buf = [0u8; 8];
    buf[..6].copy_from_slice(raw);
    Some(u64::from_le_bytes(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mariadb_gtid_and_refuses_short_input() {
        let mut data = 42u64.to_le_bytes().to_vec();
        data.extend(7u32.to_le_bytes());
        data.push(1);
        assert_eq!(
            MariaGtid::parse(&data),
            Some(MariaGtid {
                domain: 7,
                seq: 42,
                standalone: true,
                prepared_xa: false,
            })
        );
        assert_eq!(MariaGtid::parse(&data[..12]), None);
        assert_eq!(rows_event_table_id(&[1, 2, 0, 0, 0, 0, 9]), Some(0x0201));
        assert_eq!(rows_event_table_id(&[1, 2]), None);
    }

    #[test]
    fn an_xa_prepare_body_gives_the_xid_the_commit_statement_names() {
        // Captured from MariaDB 10.11: XA PREPARE 'b2','q',7.
        let body = [0, 7, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, b'b', b'2', b'q'];
        let (one_phase, xid) = parse_xa_prepare(&body).unwrap();
        assert!(!one_phase);
        assert_eq!(xid, xid_key("X'6232',X'71',7"));
        assert_eq!(
            parse_xa_prepare(&body[..15]),
            None,
            "a short body is refused"
        );
        assert_eq!(
            parse_xa_prepare(&[1, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]),
            None
        );
    }
}
