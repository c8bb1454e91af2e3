CREATE ROLE cdc WITH LOGIN REPLICATION PASSWORD 'cdc-dev-only';
CREATE TABLE public.outbox (
  id            uuid        PRIMARY KEY,
  aggregatetype text        NOT NULL,
  aggregateid   text        NOT NULL,
  type          text        NOT NULL,
  payload       jsonb,
  created_at    timestamptz NOT NULL DEFAULT now()
);
-- outboxd creates the publication on first start; that needs ownership of the table and CREATE on the database.
ALTER TABLE public.outbox OWNER TO cdc;
GRANT CREATE ON DATABASE app TO cdc;
