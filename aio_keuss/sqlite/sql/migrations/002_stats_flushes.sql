-- The last flush of counters each stats store (one per factory, named by a random origin)
-- had applied: a flush whose outcome its caller did not learn (cancelled while the database
-- thread ran it) is sent again with the same number, and applied only if that number is
-- past the one recorded, in the same transaction as the counters (see stats_flush_claim).
-- A factory closing cleanly deletes its row; rows not written for a week (a process that
-- ended without closing) are deleted by the next factory to open.
CREATE TABLE IF NOT EXISTS stats_flushes (
    origin TEXT PRIMARY KEY,
    seq    INTEGER NOT NULL,
    at     REAL NOT NULL
) WITHOUT ROWID;
