//! Which routed columns the publication will actually send (a `check` line).
//!
//! A column the table has is not always a column pgoutput sends: a generated column is sent only by
//! PostgreSQL 18+, only when stored, and only with the publication's `publish_generated_columns =
//! stored`; a virtual generated column (18) never; and a publication with a column list (15+) sends
//! only the listed columns. A routed column that is never sent would make every row unroutable at
//! run time, so `check` fails on it, naming the column, why, and the fix.

use tokio_postgres::Client;

use super::control::{quote_ident, quote_table, split_table, Server};
use crate::preflight::Item;

/// PostgreSQL 18 (`server_version_num`): stored generated columns may be published.
const PUBLISHED_GENERATED: i32 = 180_000;
/// PostgreSQL 15: publications with column lists, and `pg_publication_tables.attnames`.
const COLUMN_LISTS: i32 = 150_000;

/// Whether `publication` sends stored generated columns (18's `publish_generated_columns =
/// stored`); false before 18, and for a publication that does not exist yet.
pub async fn stored_generated_sent(
    client: &Client,
    publication: &str,
) -> Result<bool, tokio_postgres::Error> {
    Ok(client
        .query_opt(
            "SELECT to_jsonb(p)->>'pubgencols' FROM pg_publication p WHERE p.pubname = $1",
            &[&publication],
        )
        .await?
        .and_then(|r| r.get::<_, Option<String>>(0))
        .is_some_and(|v| v == "s" || v == "true"))
}

/// Why a column is not sent.
enum Unsent {
    /// A stored generated column before 18, or on 18 without `publish_generated_columns = stored`.
    Stored,
    /// A virtual generated column (18): never sent.
    Virtual,
    /// Left out of the publication's column list.
    NotListed,
}

/// The FAIL line for routed columns of `table` that `publication` (which may not exist yet: then
/// as outboxd creates it) will not send; `None` when every routed column is sent.
pub async fn item(
    client: &Client,
    server: &Server,
    table: &str,
    publication: &str,
    wanted: &[String],
    subject: &'static str,
) -> Result<Option<Item>, tokio_postgres::Error> {
    let (schema, name) = split_table(table);
    let generated: Vec<(String, String)> = client
        .query(
            "SELECT a.attname::text, a.attgenerated::text FROM pg_attribute a \
             WHERE a.attrelid = $1::text::regclass AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated <> ''",
            &[&quote_table(table)],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let stored_published =
        server.number >= PUBLISHED_GENERATED && stored_generated_sent(client, publication).await?;
    // The columns the publication sends, where it exists and the server can say (15+).
    let listed: Option<Vec<String>> = if server.number >= COLUMN_LISTS {
        client
            .query_opt(
                "SELECT attnames::text[] FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                &[&publication, &schema, &name],
            )
            .await?
            .map(|r| r.get(0))
    } else {
        None
    };
    let mut unsent = Vec::new();
    for column in wanted {
        let why = match generated.iter().find(|(c, _)| c == column) {
            Some((_, kind)) if kind == "v" => Some(Unsent::Virtual),
            Some(_) if !stored_published => Some(Unsent::Stored),
            _ => match &listed {
                Some(names) if !names.iter().any(|n| n == column) => Some(Unsent::NotListed),
                _ => None,
            },
        };
        if let Some(why) = why {
            unsent.push((column.as_str(), why));
        }
    }
    let Some((_, first)) = unsent.first() else {
        return Ok(None);
    };
    let columns: Vec<&str> = unsent.iter().map(|(c, _)| *c).collect();
    let (why, fix) = match first {
        Unsent::Virtual => (
            "virtual generated columns are never sent by logical replication".to_string(),
            "make the column STORED (18 can publish stored generated columns), compute the value in the INSERT, or point [route] at another column".to_string(),
        ),
        Unsent::Stored if server.number >= PUBLISHED_GENERATED => (
            format!("generated columns are sent only when publication {publication} has publish_generated_columns = stored"),
            format!("ALTER PUBLICATION {} SET (publish_generated_columns = stored);", quote_ident(publication)),
        ),
        Unsent::Stored => (
            format!("PostgreSQL {} does not send generated columns through logical replication (18 can)", server.version),
            "compute the value in the INSERT (or a trigger), or point [route] at another column".to_string(),
        ),
        Unsent::NotListed => (
            format!("publication {publication} has a column list without them"),
            format!(
                "BEGIN; ALTER PUBLICATION {p} DROP TABLE {t}; ALTER PUBLICATION {p} ADD TABLE {t}; COMMIT; (the table again, without a column list)",
                p = quote_ident(publication),
                t = quote_table(table)
            ),
        ),
    };
    Ok(Some(Item::fail(
        subject,
        format!(
            "routed column(s) {} of {table} never reach outboxd: {why}; every row would be unroutable",
            columns.join(", ")
        ),
        fix,
    )))
}
