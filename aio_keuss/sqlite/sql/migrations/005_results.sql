-- Results of finished messages (aio_keuss.sqlite.results): the body the queue layer
-- encoded, by (queue, id), kept until ``expires``, float seconds since the epoch on SQLite's
-- clock. A row past ``expires`` is never read; rows are deleted in bounded batches, found by
-- the index on ``expires``. A rowid table rather than WITHOUT ROWID: a body may be large,
-- and WITHOUT ROWID suits rows smaller than about a twentieth of a page (SQLite
-- documentation, "Clustered Indexes and the WITHOUT ROWID Optimization", 4).
CREATE TABLE IF NOT EXISTS results (
    queue   TEXT NOT NULL,
    id      TEXT NOT NULL,
    body    BLOB NOT NULL,
    expires REAL NOT NULL,
    PRIMARY KEY (queue, id)
);
CREATE INDEX IF NOT EXISTS results_by_expires ON results (expires);
