-- The number of the last state write of a bucket's lease: a write is applied only when its
-- number is past this one (in the same statement as the owner check), so an older write of
-- the same lease that reaches the server late (its reply lost, a newer one sent since) no
-- longer rolls the state back. A lease sets it back to 0. Rows of the earlier release read
-- 0; a constant default is stored in the catalog, not written to every row (PostgreSQL
-- manual, ALTER TABLE: "Adding a column with a constant default ... does not require the
-- table to be rewritten"), so the step takes no longer on a big table.
ALTER TABLE {s}.buckets ADD COLUMN IF NOT EXISTS seq bigint NOT NULL DEFAULT 0;
