//! WAL positions (LSNs): the 64-bit byte offset into the WAL, printed the way Postgres prints
//! `pg_lsn` (`0/16B3748`: the high and low 32 bits in hex).

use std::fmt;

/// A WAL position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl Lsn {
    /// Parses `0/16B3748` (either case, 1 to 8 hex digits a side).
    pub fn parse(text: &str) -> Option<Lsn> {
        parse_lsn(text).map(Lsn)
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// Formats an LSN the way Postgres prints `pg_lsn`, e.g. `0/16B3748`.
pub fn lsn_to_string(lsn: u64) -> String {
    Lsn(lsn).to_string()
}

/// Parses an LSN written like Postgres's `pg_lsn` (`0/16B3748`; either case, 1 to 8 hex digits a side).
pub fn parse_lsn(text: &str) -> Option<u64> {
    let (high, low) = text.split_once('/')?;
    Some((u64::from(lsn_half(high)?) << 32) | u64::from(lsn_half(low)?))
}

fn lsn_half(text: &str) -> Option<u32> {
    // from_str_radix alone would also take a leading '+'.
    if text.is_empty() || text.len() > 8 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(text, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_text_round_trips() {
        assert_eq!(lsn_to_string(0x16B3748), "0/16B3748");
        assert_eq!(lsn_to_string(0), "0/0");
        assert_eq!(lsn_to_string(0x0000_00AB_0000_0001), "AB/1");
        assert_eq!(lsn_to_string(u64::MAX), "FFFFFFFF/FFFFFFFF");
        for lsn in [
            0,
            1,
            0x16B3748,
            0x1_0000_0000,
            u64::MAX,
            0x1234_5678_9ABC_DEF0,
        ] {
            assert_eq!(parse_lsn(&lsn_to_string(lsn)), Some(lsn));
        }
        assert_eq!(parse_lsn("0/16b3748"), Some(0x16B3748));
        assert_eq!(parse_lsn("00000001/00000002"), Some(0x1_0000_0002));
        for bad in [
            "",
            "/",
            "0/",
            "/0",
            "0",
            "0/0/0",
            "+1/0",
            "0/-1",
            " 0/1",
            "0/1 ",
            "123456789/0",
            "0/g",
        ] {
            assert_eq!(parse_lsn(bad), None, "{bad:?}");
        }
    }
}
