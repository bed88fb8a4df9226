-- Rate limits: the count of takes a limiter refused (``contract.RateState.refused``), which
-- tells a take giving grants back whether another was refused since it took them (only then
-- is the give-back announced). A constant default: rows written before read as 0 (SQLite
-- documentation, "ALTER TABLE ... ADD COLUMN").
ALTER TABLE rates ADD COLUMN refused INTEGER NOT NULL DEFAULT 0;
