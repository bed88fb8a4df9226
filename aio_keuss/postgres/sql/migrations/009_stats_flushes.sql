-- The last flush of counters each stats store (one per factory, named by a random origin)
-- had applied: a flush whose reply was lost is sent again with the same number, and applied
-- only if that number is past the one recorded, so the server applies it once (see
-- stats_apply). A factory closing cleanly deletes its row; rows not written for a week
-- (a process that ended without closing) are deleted by the next factory to open.
CREATE TABLE IF NOT EXISTS {s}.stats_flushes (
    origin text PRIMARY KEY,
    seq    bigint NOT NULL,
    at     timestamptz NOT NULL DEFAULT now()
);
