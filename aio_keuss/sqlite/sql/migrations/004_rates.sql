-- Rate limits: a row per rate-limited queue, its limiter's state (``contract.RateState``):
-- ``tat``, GCRA's theoretical arrival time, and ``held_until``, deliveries held until then
-- (a handler's RateLimited), float seconds since the epoch on SQLite's clock. A row whose
-- two times are past is the same as none: the step that finds it so deletes it, and a step
-- that makes a row deletes up to a hundred other such rows (queues idle since), found by
-- the index on the later of the two times.
CREATE TABLE IF NOT EXISTS rates (
    queue      TEXT PRIMARY KEY,
    tat        REAL NOT NULL,
    held_until REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS rates_by_expiry ON rates (max(tat, held_until));
