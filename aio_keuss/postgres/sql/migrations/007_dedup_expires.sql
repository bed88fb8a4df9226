-- The idempotent insert purges expired dedup rows of its queue on the way; without an index
-- on expiry that purge read every dedup row of the queue on every insert. Ordered by
-- (queue, expires), it reads only rows already expired. Expiry times grow with time, so
-- new entries land at the right edge of the index, the cheapest place to insert.
CREATE INDEX IF NOT EXISTS dedup_by_expires ON {s}.dedup (queue, expires);
