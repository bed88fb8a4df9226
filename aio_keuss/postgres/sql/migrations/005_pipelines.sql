-- Pipeline topologies (stations, their queues and handlers' names), stored so that any
-- process can list the pipelines of a schema; written when a pipeline starts.
CREATE TABLE IF NOT EXISTS {s}.pipelines (
    name     text PRIMARY KEY,
    topology jsonb NOT NULL,
    saved_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
