-- Every statement of the sqlite backend, each after a "-- name: <name>" line: the store,
-- the stats store, the rate limiters, the signal bus and the results. The store runs several of them in one write
-- transaction (BEGIN IMMEDIATE) per primitive; "?" are positional parameters, and times
-- are float seconds since the epoch from the caller (the clock of the machine every
-- process sharing the file runs on).

-- The store ------------------------------------------------------------------------------

-- name: insert
-- One message; ignored (no row changed) when the queue holds its id already.
INSERT OR IGNORE INTO messages (queue, id, mature, tries, payload, headers, priority)
VALUES (?, ?, ?, ?, ?, ?, ?)

-- name: dedup_active
-- Whether an id the user chose is remembered within its window: (queue, id, now).
SELECT 1 FROM dedup WHERE queue = ? AND id = ? AND expires > ?

-- name: dedup_remember
INSERT INTO dedup (queue, id, expires) VALUES (?, ?, ?)
ON CONFLICT (queue, id) DO UPDATE SET expires = excluded.expires

-- name: dedup_purge
-- Up to a hundred expired ids of a queue, found by the (queue, expires) index: (queue, now).
DELETE FROM dedup WHERE queue = ?1 AND id IN (
    SELECT id FROM dedup WHERE queue = ?1 AND expires <= ?2 LIMIT 100)

-- name: level_below
-- The highest priority of the queue below ?2 (past the largest priority: the highest of
-- all): one seek in the (queue, priority DESC, mature, seq) index, whatever the messages of
-- the priorities passed. Peek walks a queue's priorities with it, one after another.
SELECT priority FROM messages
WHERE queue = ?1 AND priority < ?2
ORDER BY priority DESC
LIMIT 1

-- name: mature
-- Up to ?3 messages of the queue's priorities below ?2, the highest priority first, then
-- earliest first: the order of the (queue, priority DESC, mature, seq) index. A take reads
-- them one by one only as far as the first one not mature: the messages of that priority
-- after it are not mature either, and the take goes on with the priorities below it in a
-- statement of its own. So a priority whose messages are all reserved or delayed costs one
-- row, and a queue with one priority (0 for all that never had one) one statement. tries
-- counts a delivery whose reservation expired (reserved and mature again) as a try.
SELECT seq, id, payload, headers, tries + reserved, mature, priority FROM messages
WHERE queue = ?1 AND priority < ?2
ORDER BY priority DESC, mature, seq
LIMIT ?3

-- name: delete_seq
DELETE FROM messages WHERE seq = ?

-- name: reserve_seq
-- (deadline, seq)
UPDATE messages SET mature = ?, tries = tries + reserved, reserved = 1 WHERE seq = ?

-- name: next_mature
-- The earliest mature time of a queue (NULL: empty): the earliest of each of its priorities,
-- found by walking them down from the highest, two seeks a priority (SQLite documentation,
-- "The WITH Clause", recursive common table expressions); SQLite's own skip-scan would need
-- ANALYZE's statistics to be chosen, and ordering the queue by mature time alone a sort.
WITH RECURSIVE level(priority) AS (
    SELECT (SELECT priority FROM messages WHERE queue = ?1
            ORDER BY priority DESC LIMIT 1)
    UNION ALL
    SELECT (SELECT priority FROM messages WHERE queue = ?1 AND priority < level.priority
            ORDER BY priority DESC LIMIT 1)
    FROM level WHERE level.priority IS NOT NULL
)
SELECT min((SELECT mature FROM messages WHERE queue = ?1 AND priority = level.priority
            ORDER BY mature, seq LIMIT 1))
FROM level WHERE level.priority IS NOT NULL

-- name: held
-- A message under reservation with the tries its holder was given (NULL: any):
-- (queue, id, tries). Answers its seq, tries, payload and headers.
SELECT seq, tries, payload, headers FROM messages
WHERE queue = ?1 AND id = ?2 AND reserved = 1 AND (?3 IS NULL OR tries = ?3)

-- name: commit
-- Delete what is still reserved with the tries its holder was given (NULL: any):
-- (queue, id, tries); a consumer whose reservation expired and went to someone else
-- deletes nothing.
DELETE FROM messages
WHERE queue = ?1 AND id = ?2 AND reserved = 1 AND (?3 IS NULL OR tries = ?3)

-- name: extend
-- Push the deadline of what is still reserved with the tries its holder was given (NULL:
-- any), the guard of a commit: (queue, id, tries, deadline). tries and reserved stay, so a
-- lapsed reservation nobody took since is extended as it was, and its holder's ok still
-- matches.
UPDATE messages SET mature = ?4
WHERE queue = ?1 AND id = ?2 AND reserved = 1 AND (?3 IS NULL OR tries = ?3)

-- name: release_seq
-- A rollback: (tries, mature, seq).
UPDATE messages SET tries = ?, reserved = 0, mature = ? WHERE seq = ?

-- name: name_taken
-- Whether queue ?1 holds a message called ?2 other than the one being moved (seq ?3).
SELECT 1 FROM messages WHERE queue = ?1 AND id = ?2 AND seq <> ?3

-- name: move_seq
-- The one body of a move (Queue.move, a deadletter): (queue, id, mature, payload, headers,
-- seq); tries start over and the reservation ends.
UPDATE messages
SET queue = ?, id = ?, tries = 0, reserved = 0, mature = ?, payload = ?, headers = ?
WHERE seq = ?

-- name: remove
-- Anything of the queue but an active reservation: (queue, id, now).
DELETE FROM messages
WHERE queue = ? AND id = ? AND NOT (reserved = 1 AND mature > ?3)

-- name: amend
-- Change a waiting message where it stands (Queue.promote, reschedule, change_priority):
-- (queue, id, mature, priority, now, scheduled_only); a NULL mature or priority stays. The
-- rule of "remove": anything of the queue but an active reservation, so a lapsed one too,
-- which becomes waiting: the lapse is counted as the try the next reserve would count
-- (tries + reserved), and its old holder's ok, extend or ko no longer find it. With
-- scheduled_only, only a message whose mature time is still ahead (never reserved then).
-- Every right-hand side reads the row as it was (SQLite documentation, "UPDATE"). The seq
-- stays, so within its priority it keeps its place by mature time and push order.
UPDATE messages
SET mature = coalesce(?3, mature), priority = coalesce(?4, priority),
    tries = tries + reserved, reserved = 0
WHERE queue = ?1 AND id = ?2 AND NOT (reserved = 1 AND mature > ?5)
  AND (NOT ?6 OR mature > ?5)

-- name: sizes
-- (queue, now): ready, total, scheduled, reserved, in one statement (one snapshot). The
-- total is a count of the queue's index entries alone, never its rows (a covering index
-- scan); what is past now (scheduled or reserved) is one range of the index per priority,
-- walked as in "next_mature", and only those rows are read, for their reserved flag. Ready
-- is the rest: everything not past now. Summed over every row of the queue instead, a
-- sizes() read each message of a backlog, holding the factory's one database thread, and
-- so its every call, several times as long.
WITH RECURSIVE level(priority) AS (
    SELECT (SELECT priority FROM messages WHERE queue = ?1
            ORDER BY priority DESC LIMIT 1)
    UNION ALL
    SELECT (SELECT priority FROM messages WHERE queue = ?1 AND priority < level.priority
            ORDER BY priority DESC LIMIT 1)
    FROM level WHERE level.priority IS NOT NULL
), later(n, reserved) AS (
    SELECT (SELECT count(*) FROM messages
            WHERE queue = ?1 AND priority = level.priority AND mature > ?2),
           (SELECT coalesce(sum(reserved), 0) FROM messages
            WHERE queue = ?1 AND priority = level.priority AND mature > ?2)
    FROM level WHERE level.priority IS NOT NULL
), counts(total, n, reserved) AS (
    SELECT (SELECT count(*) FROM messages WHERE queue = ?1),
           (SELECT coalesce(sum(n), 0) FROM later),
           (SELECT coalesce(sum(reserved), 0) FROM later)
)
SELECT total - n, total, n - reserved, reserved FROM counts

-- name: peek
-- Look without taking: up to ?5 messages of priority ?8 in state ?4 past the cursor (?2
-- mature, ?3 seq), in the order of that priority's stretch of the (queue, priority DESC,
-- mature, seq) index, which the row value comparison walks (SQLite documentation, "Row
-- Values"), up to mature ?7 (now for ready messages, else infinity), which bounds that
-- walk; ?6 is now.
SELECT seq, id, payload, headers, tries, mature, reserved, priority FROM messages
WHERE queue = ?1 AND priority = ?8 AND (mature, seq) > (?2, ?3) AND mature <= ?7
  AND CASE ?4 WHEN 'ready' THEN mature <= ?6
              WHEN 'scheduled' THEN mature > ?6 AND reserved = 0
              WHEN 'reserved' THEN mature > ?6 AND reserved = 1
              ELSE 1 END
ORDER BY mature, seq
LIMIT ?5

-- name: locate
SELECT seq, id, payload, headers, tries, mature, reserved, priority FROM messages
WHERE queue = ? AND id = ?

-- name: hold_seq
-- Reserve a given message (requeue) as reserve does: (deadline, seq).
UPDATE messages SET mature = ?, tries = tries + reserved, reserved = 1 WHERE seq = ?

-- The stats store ------------------------------------------------------------------------

-- name: stats_apply
INSERT INTO stats (queue, counter, value) VALUES (?, ?, ?)
ON CONFLICT (queue, counter) DO UPDATE SET value = value + excluded.value

-- name: stats_flush_claim
-- Record flush ?2 of stats store ?1 (at ?3) unless that one or a later one was: one row
-- changed means the flush is new, and its counters are applied in the same transaction;
-- none, that it was applied already (sent again, its first outcome unknown to the store).
INSERT INTO stats_flushes (origin, seq, at) VALUES (?1, ?2, ?3)
ON CONFLICT (origin) DO UPDATE SET seq = excluded.seq, at = excluded.at
WHERE stats_flushes.seq < excluded.seq

-- name: stats_flushed
-- The number of the last flush stats store ? had applied (no row: none).
SELECT seq FROM stats_flushes WHERE origin = ?

-- name: stats_forget_flushes
-- A stats store closing with nothing unsettled.
DELETE FROM stats_flushes WHERE origin = ?

-- name: stats_forget_stale_flushes
-- The stats stores silent since ? (a week ago): processes that ended without closing.
DELETE FROM stats_flushes WHERE at < ?

-- name: stats_counters
SELECT counter, value FROM stats WHERE queue = ?

-- name: stats_reset
DELETE FROM stats WHERE queue = ?

-- name: stats_set_paused
INSERT INTO queues (queue, paused) VALUES (?, ?)
ON CONFLICT (queue) DO UPDATE SET paused = excluded.paused

-- name: stats_is_paused
SELECT paused FROM queues WHERE queue = ?

-- name: stats_save_options
INSERT INTO queues (queue, options) VALUES (?, ?)
ON CONFLICT (queue) DO UPDATE SET options = excluded.options

-- name: stats_keep_options
-- Record a queue's options unless some are recorded ('{}': a row made by a pause only).
INSERT INTO queues (queue, options) VALUES (?, ?)
ON CONFLICT (queue) DO UPDATE SET options = excluded.options WHERE queues.options = '{}'

-- name: stats_queues
SELECT queue, options FROM queues ORDER BY queue

-- name: stats_save_pipeline
INSERT INTO pipelines (name, topology, saved_at) VALUES (?, ?, ?)
ON CONFLICT (name) DO UPDATE SET topology = excluded.topology, saved_at = excluded.saved_at

-- name: stats_keep_pipeline
INSERT INTO pipelines (name, topology, saved_at) VALUES (?, ?, ?)
ON CONFLICT (name) DO NOTHING

-- name: stats_pipeline
SELECT topology FROM pipelines WHERE name = ?

-- name: stats_pipelines
SELECT name, topology FROM pipelines ORDER BY name

-- name: stats_remove_pipeline
DELETE FROM pipelines WHERE name = ?

-- The rate limiters (aio_keuss.sqlite.limiter) ----------------------------------------------

-- name: rate_state
-- SQLite's clock and the queue's limiter state (NULLs: none), read in one step, so with one
-- "now" (SQLite documentation, "Date And Time Functions": 'now' is the same for every use
-- within one sqlite3_step). julianday holds whole milliseconds; rounded back to them, the
-- epoch seconds are exact to the millisecond rather than a double's rounding of a day count.
SELECT round((julianday('now') - 2440587.5) * 86400000.0) / 1000.0, r.tat, r.held_until,
    r.refused
FROM (SELECT 1) LEFT JOIN rates AS r ON r.queue = ?

-- name: rate_save
INSERT INTO rates (queue, tat, held_until, refused) VALUES (?, ?, ?, ?)
ON CONFLICT (queue) DO UPDATE SET tat = excluded.tat, held_until = excluded.held_until,
    refused = excluded.refused

-- name: rate_forget
DELETE FROM rates WHERE queue = ?

-- name: rate_purge
-- Up to a hundred limiters whose times are both past (now): the same as none.
DELETE FROM rates WHERE queue IN (
    SELECT queue FROM rates WHERE max(tat, held_until) <= ?1 LIMIT 100)

-- The signal bus -------------------------------------------------------------------------

-- name: signal_publish
INSERT INTO signals (at, payload) VALUES (?, ?)

-- name: signal_prune
-- Rows older than a minute: every listener has read them long before.
DELETE FROM signals WHERE at < ?

-- name: signal_last
SELECT coalesce(max(seq), 0) FROM signals

-- name: signal_since
SELECT seq, payload FROM signals WHERE seq > ? ORDER BY seq

-- The results (aio_keuss.sqlite.results) --------------------------------------------------

-- name: result_clock
-- SQLite's clock in epoch seconds, the one the rate limiters use (julianday('now')): every
-- process sharing the file runs on the machine that holds it.
SELECT (julianday('now') - 2440587.5) * 86400.0

-- name: result_put
-- One result, replacing any of the same (queue, id) and its expiry: (queue, id, body,
-- expires).
INSERT INTO results (queue, id, body, expires) VALUES (?, ?, ?, ?)
ON CONFLICT (queue, id) DO UPDATE SET body = excluded.body, expires = excluded.expires

-- name: result_replace
-- One result's body replaced where its unexpired body is the one given, with a new
-- expiry: (body, expires, queue, id, old, now). Run inside the write transaction of the
-- batch, so nothing comes between the compare and the write.
UPDATE results SET body = ?, expires = ?
WHERE queue = ? AND id = ? AND body = ? AND expires > ?

-- name: result_get
-- One unexpired result by its primary key: (queue, id, now).
SELECT body FROM results WHERE queue = ? AND id = ? AND expires > ?

-- name: result_reclaim
-- Up to ?1 expired results of any queue, found by the index on expires, on SQLite's clock.
DELETE FROM results WHERE rowid IN (
    SELECT rowid FROM results
    WHERE expires <= (julianday('now') - 2440587.5) * 86400.0
    LIMIT ?1)
