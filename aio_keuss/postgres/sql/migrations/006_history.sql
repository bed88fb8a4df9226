-- Consumed messages kept for a while (the ``history=True`` option of the postgres backend):
-- what a pop, an ok or a remove deletes from ``messages`` is copied here by a statement
-- trigger over the deleted rows (a transition table, PostgreSQL manual "CREATE TRIGGER"),
-- which connecting with history=True installs on the schema. Rows older than
-- ``history_ttl`` are deleted by the connected clients, a bounded batch at a time.
CREATE TABLE IF NOT EXISTS {s}.history (
    queue     text NOT NULL,
    id        text NOT NULL,
    seq       bigint GENERATED ALWAYS AS IDENTITY,
    processed double precision NOT NULL,
    tries     integer NOT NULL,
    payload   bytea NOT NULL,
    headers   bytea NOT NULL,
    PRIMARY KEY (queue, processed, seq)
);
CREATE INDEX IF NOT EXISTS history_by_id ON {s}.history (queue, id);
CREATE INDEX IF NOT EXISTS history_by_time ON {s}.history (processed);
CREATE OR REPLACE FUNCTION {s}.keep_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {s}.history (queue, id, processed, tries, payload, headers)
    SELECT queue, id, extract(epoch from now())::float8, tries, payload, headers FROM gone;
    RETURN NULL;
END
$$;
