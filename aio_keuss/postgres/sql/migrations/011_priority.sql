-- Priorities (push(..., priority=)): of the messages ready, the highest priority is taken
-- first. Rows of earlier releases read 0; a constant default is stored in the catalog, not
-- written to every row (PostgreSQL manual, ALTER TABLE: "Adding a column with a constant
-- default ... does not require the table to be rewritten"), so adding it is instant, though
-- it waits for the table's running transactions (ACCESS EXCLUSIVE, held for a moment).
-- The index holds only rows with a priority: a queue that never uses one keeps taking from
-- messages_by_mature alone and writes no entry here. Building it reads the whole table and
-- blocks writes to it meanwhile (it stays empty on a table of earlier releases); CREATE
-- INDEX CONCURRENTLY does not, but cannot run in this step's transaction: on a big table,
-- run both statements beforehand, the second as CREATE INDEX CONCURRENTLY, and this step
-- finds them in place (PostgreSQL manual, CREATE INDEX: "Building Indexes Concurrently").
ALTER TABLE {s}.messages ADD COLUMN IF NOT EXISTS priority smallint NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS messages_by_priority ON {s}.messages (queue, priority DESC, mature, seq)
    WHERE priority <> 0;
