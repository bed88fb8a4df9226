-- The schema as the first release made it: every statement is IF NOT EXISTS, so a schema
-- that release created (it had no versions table) takes this step as a no-op.
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.messages (
    queue    text NOT NULL,
    id       text NOT NULL,
    seq      bigint GENERATED ALWAYS AS IDENTITY,
    mature   double precision NOT NULL,
    tries    integer NOT NULL DEFAULT 0,
    reserved boolean NOT NULL DEFAULT false,
    payload  bytea NOT NULL,
    headers  bytea NOT NULL,
    PRIMARY KEY (queue, id)
);
CREATE INDEX IF NOT EXISTS messages_by_mature ON {s}.messages (queue, mature, seq);
CREATE TABLE IF NOT EXISTS {s}.dedup (
    queue   text NOT NULL,
    id      text NOT NULL,
    expires double precision NOT NULL,
    PRIMARY KEY (queue, id)
);
CREATE TABLE IF NOT EXISTS {s}.stats (
    queue   text NOT NULL,
    counter text NOT NULL,
    value   bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (queue, counter)
);
CREATE TABLE IF NOT EXISTS {s}.queues (
    queue   text PRIMARY KEY,
    options jsonb NOT NULL DEFAULT '{}',
    paused  boolean NOT NULL DEFAULT false
);
