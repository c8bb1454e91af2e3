//! Trace context from the writing transaction to the consumer: W3C `traceparent` / `tracestate`
//! headers from Debezium's `tracingspancontext` column (Java properties text, as Debezium's
//! OpenTelemetry integration writes it) or from plain `traceparent` / `tracestate` columns.

use crate::source::Row;

pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";

/// The `(traceparent, tracestate)` a row carries, if any. `span_column` is Debezium's
/// `tracing.span.context.field` (default `tracingspancontext`).
pub fn context(row: &Row, span_column: &str) -> (Option<String>, Option<String>) {
    if let Some(text) = row.get(span_column).and_then(|v| v.render()) {
        let mut parent = None;
        let mut state = None;
        for line in text.lines() {
            let line = line.trim();
            if line.starts_with('#') || line.starts_with('!') {
                continue;
            }
            let Some((key, value)) = line.split_once(['=', ':']) else {
                continue;
            };
            let value = unescape(value.trim());
            match key.trim() {
                TRACEPARENT if !value.is_empty() => parent = Some(value),
                TRACESTATE if !value.is_empty() => state = Some(value),
                _ => {}
            }
        }
        if parent.is_some() {
            return (parent, state);
        }
    }
    let column = |name: &str| {
        row.get(name)
            .and_then(|v| v.render())
            .filter(|s| !s.trim().is_empty())
    };
    match column(TRACEPARENT) {
        Some(parent) => (Some(parent), column(TRACESTATE)),
        None => (None, None),
    }
}

/// Java properties escapes (`Properties.store` writes `=` and `:` in values as `\=`, `\:`).
fn unescape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let mut chars = value.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('t') => out.push('\t'),
                Some('n') => out.push('\n'),
                Some(other) => out.push(other),
                None => {}
            }
        } else {
            out.push(c);
        }
    }
    out
}
