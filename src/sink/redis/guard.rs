//! The exactly-once commit's guard: the checkpoint is stored by a script queued last in the
//! transaction, and only if every stream the transaction wrote to ends with the transaction's own
//! last entry for it.
//!
//! Why: inside `EXEC` a command that fails does not stop the others (Redis has no rollback). An
//! `XADD` can fail there even after outboxd asked the key's type: the type changed since, an ACL
//! rule changed, the stream's IDs were exhausted (`XSETID`). A plain `SET` of the checkpoint would
//! then store a position past a row that is not in its stream. Nothing runs between the commands of
//! one `EXEC`, so a script queued after the entries sees exactly what they did. A failure is
//! uniform per stream within one transaction (a key's type, an ACL rule on a key or on `XADD`, an
//! exhausted stream refuse every later `XADD` too), so "the newest entry of each stream is ours"
//! holds exactly when every entry was written; the entry is known by its `id` and
//! `outboxd.position` fields, and a position belongs to one source transaction, which is never
//! split between two Redis transactions. If the guard refuses, the checkpoint stays where it was
//! and the transaction's written entries are sent again after the fix: duplicates, never a loss.

use std::collections::HashMap;

use crate::route::{ID_HEADER, POSITION_HEADER};

/// `KEYS[1]`: the checkpoint key; `KEYS[2..]`: the streams. `ARGV[1]`: the checkpoint;
/// `ARGV[2k-2], ARGV[2k-1]`: the `id` (empty: the entry has none) and `outboxd.position` of the
/// last entry written to `KEYS[k]`.
const SCRIPT: &str = r#"
for k = 2, #KEYS do
  local want_id, want_pos = ARGV[2 * k - 2], ARGV[2 * k - 1]
  if redis.call('TYPE', KEYS[k]).ok ~= 'stream' then
    return redis.error_reply('OUTBOXD_NOT_WRITTEN ' .. KEYS[k])
  end
  local newest = redis.call('XREVRANGE', KEYS[k], '+', '-', 'COUNT', 1)
  local id, pos = '', ''
  if newest[1] then
    local fields = newest[1][2]
    for i = 1, #fields, 2 do
      if fields[i] == 'id' then id = fields[i + 1] end
      if fields[i] == 'outboxd.position' then pos = fields[i + 1] end
    end
  end
  if id ~= want_id or pos ~= want_pos then
    return redis.error_reply('OUTBOXD_NOT_WRITTEN ' .. KEYS[k])
  end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"#;

/// The error code the script answers with when a stream does not end with the transaction's
/// last entry for it.
pub(super) const NOT_WRITTEN: &str = "OUTBOXD_NOT_WRITTEN";

/// The newest entry the transaction wrote to each stream, in order of first write.
#[derive(Default)]
pub(super) struct Newest {
    order: Vec<String>,
    last: HashMap<String, (Vec<u8>, Vec<u8>)>,
}

impl Newest {
    /// An entry for `stream` with these fields was queued.
    pub fn wrote(&mut self, stream: &str, fields: &[(String, Vec<u8>)]) {
        let field = |name: &str| {
            fields
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        let mark = (field(ID_HEADER), field(POSITION_HEADER));
        if self.last.insert(stream.to_string(), mark).is_none() {
            self.order.push(stream.to_string());
        }
    }

    pub fn clear(&mut self) {
        self.order.clear();
        self.last.clear();
    }

    /// `EVAL` of the guard, storing `body` at `key` if every stream ends with its entry.
    pub fn store(&self, key: &str, body: &[u8]) -> redis::Cmd {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(SCRIPT).arg(1 + self.order.len()).arg(key);
        for stream in &self.order {
            cmd.arg(stream);
        }
        cmd.arg(body);
        for stream in &self.order {
            let (id, position) = &self.last[stream];
            cmd.arg(id.as_slice()).arg(position.as_slice());
        }
        cmd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guard_names_each_stream_once_with_its_last_entry() {
        let mut newest = Newest::default();
        let entry = |id: &str, pos: &str| {
            vec![
                ("id".to_string(), id.as_bytes().to_vec()),
                ("outboxd.position".to_string(), pos.as_bytes().to_vec()),
            ]
        };
        newest.wrote("a", &entry("1", "gtid:0-1-5"));
        newest.wrote("b", &entry("2", "gtid:0-1-5"));
        newest.wrote("a", &entry("3", "gtid:0-1-6"));
        let cmd = newest.store("ck", b"{}");
        let args: Vec<String> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                _ => "<other>".into(),
            })
            .collect();
        assert_eq!(args[0], "EVAL");
        assert_eq!(
            &args[2..],
            &[
                "3",
                "ck",
                "a",
                "b",
                "{}",
                "3",
                "gtid:0-1-6",
                "2",
                "gtid:0-1-5"
            ]
        );
    }
}
