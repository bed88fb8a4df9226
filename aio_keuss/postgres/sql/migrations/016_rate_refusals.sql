-- Rate limits: the count of takes a limiter refused (``contract.RateState.refused``), which
-- tells a take giving grants back whether another was refused since it took them (only then
-- is the give-back announced). A constant default: adding it rewrites no row, and rows
-- written before, or by a client that does not know it, read as 0 (PostgreSQL manual,
-- "ALTER TABLE": a non-volatile DEFAULT is stored in the catalog).
ALTER TABLE {s}.rate_limits ADD COLUMN IF NOT EXISTS refused bigint NOT NULL DEFAULT 0;
