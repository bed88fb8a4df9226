-- Priorities: of the mature messages of a queue, the highest priority is handed out first,
-- then by (mature, seq) as before. The column comes with a constant default, so adding it
-- rewrites no row: rows written before read as priority 0 (SQLite documentation, "ALTER
-- TABLE ... ADD COLUMN"). The (queue, mature, seq) index becomes (queue, priority DESC,
-- mature, seq), built once from the table in the migrating transaction, rather than a
-- second index every push, take and ok of every queue would keep up as well. A queue's
-- mature messages of one priority are then one stretch of it, and its priorities are
-- walked one index seek each (see the queries "level_below", "mature", "next_mature").
ALTER TABLE messages ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
DROP INDEX IF EXISTS messages_by_mature;
CREATE INDEX IF NOT EXISTS messages_by_priority ON messages (queue, priority DESC, mature, seq);
