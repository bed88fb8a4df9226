-- Every statement of the PostgreSQL backends, each after a "-- name: <name>" line, in six
-- parts: the postgres store (one statement per primitive), the rate limiters, the stats
-- store, the result store, the signal bus, and the bucket storage of bucket-postgres. {s} is the quoted schema; {relax} is
-- empty, or the condition that relaxes synchronous_commit (durable_acks=False); a block
-- named _x is a fragment, pasted where a statement says {_x}. The tables are made by the
-- steps in migrations/.

-- The postgres store -------------------------------------------------------------------
-- $1 is always the queue name. "now" is extract(epoch from now()): the server's clock,
-- stable within the statement, usable as an index condition (amend alone reads
-- clock_timestamp(): see there).

-- name: insert_new
-- Insert new messages without user ids (every push but an idempotent one): no dedup table
-- involved, tries 0, mature now + delay. Four columns where insert below takes six: the
-- arrays a push batch costs to encode, send and unnest are much of its statement's work
-- besides the commit. No ON CONFLICT clause, and so nothing to return: generated ids do not
-- collide, and a speculative insertion costs every row one more index probe and one more WAL
-- record (PostgreSQL manual, INSERT, "ON CONFLICT Clause"). Should an id be taken after all,
-- the statement fails whole, having inserted nothing, and the store sends the batch again
-- through insert, which refuses just the taken ids.
INSERT INTO {s}.messages (queue, id, mature, tries, payload, headers)
SELECT $1, e.id, extract(epoch from now())::float8 + e.delay, 0, e.payload, e.headers
FROM unnest($2::text[], $3::bytea[], $4::bytea[], $5::float8[])
     WITH ORDINALITY AS e(id, payload, headers, delay, ord)
ORDER BY e.ord

-- name: insert
-- Insert without user ids where some entry is a put-back (a popped message whose caller was
-- cancelled), or where insert_new found an id taken: no dedup table involved. A put-back
-- carries its own mature time and tries; others get now + delay. $8: the priorities (a
-- batch with one goes here too, insert_new has no column for them).
INSERT INTO {s}.messages (queue, id, mature, tries, payload, headers, priority)
SELECT $1, e.id, coalesce(e.mature, extract(epoch from now())::float8 + e.delay),
       e.tries, e.payload, e.headers, e.priority
FROM unnest($2::text[], $3::bytea[], $4::bytea[], $5::float8[], $6::int4[], $7::float8[],
            $8::int2[])
     WITH ORDINALITY AS e(id, payload, headers, delay, tries, mature, priority, ord)
ORDER BY e.ord
ON CONFLICT DO NOTHING
RETURNING id

-- name: _purge_dedup
-- The dedup purge of both idempotent inserts, two CTEs: up to a hundred expired dedup rows of
-- queue $1, never one of the ids $2 this statement inserts, deleted on the way.
expired AS MATERIALIZED (
    SELECT x.id FROM {s}.dedup x
    WHERE x.queue = $1 AND x.expires <= extract(epoch from now())::float8
      AND x.id <> ALL($2::text[])
    LIMIT 100 FOR UPDATE SKIP LOCKED
), purged AS (
    DELETE FROM {s}.dedup d
    USING expired x
    WHERE d.queue = $1 AND d.id = x.id

-- name: insert_dedup
-- Insert with some user-chosen ids ($8[k] true): an id remembered in ``dedup`` within the
-- window is refused even though its message is gone; a queued one is refused by the primary
-- key. Inserted user ids are remembered until now + window ($9). A hundred expired dedup
-- rows of the queue are purged on the way (never ones this statement touches), found by
-- the (queue, expires) index; $10: the priorities. The dedup check is a scalar subquery,
-- one primary-key probe per entry: written as EXISTS, the planner may turn it into a
-- hashed subplan that reads
-- every dedup row of the queue on every insert, which made a bulk load quadratic (an
-- expression subquery is never hashed: PostgreSQL manual, "Subquery Expressions").
WITH entry AS (
    SELECT * FROM unnest($2::text[], $3::bytea[], $4::bytea[], $5::float8[], $6::int4[],
                         $7::float8[], $8::bool[], $10::int2[])
           WITH ORDINALITY AS e(id, payload, headers, delay, tries, mature, dedup, priority, ord)
), {_purge_dedup}
), inserted AS (
    INSERT INTO {s}.messages (queue, id, mature, tries, payload, headers, priority)
    SELECT $1, e.id, coalesce(e.mature, extract(epoch from now())::float8 + e.delay),
           e.tries, e.payload, e.headers, e.priority
    FROM entry e
    WHERE NOT (e.dedup AND (
        SELECT d.expires > extract(epoch from now())::float8 FROM {s}.dedup d
        WHERE d.queue = $1 AND d.id = e.id) IS TRUE)
    ORDER BY e.ord
    ON CONFLICT DO NOTHING
    RETURNING id
), remembered AS (
    INSERT INTO {s}.dedup (queue, id, expires)
    SELECT DISTINCT $1, i.id, extract(epoch from now())::float8 + $9::float8
    FROM inserted i JOIN entry e ON e.id = i.id AND e.dedup
    ON CONFLICT (queue, id) DO UPDATE SET expires = EXCLUDED.expires
)
SELECT id FROM inserted

-- name: _bulk_entry
-- The entries of both bulk-load statements: $2 ids, $3 payloads.
entry AS (
    SELECT * FROM unnest($2::text[], $3::bytea[]) WITH ORDINALITY AS e(id, payload, ord)
)

-- name: _bulk_messages
-- The messages of both bulk-load statements: new, due now + $5, headers $4 for all.
INSERT INTO {s}.messages (queue, id, mature, tries, payload, headers)
    SELECT $1, e.id, extract(epoch from now())::float8 + $5::float8, 0, e.payload, $4::bytea
    FROM entry e

-- name: insert_dedup_bulk_new
-- The first try of a bulk load (a Spark write): insert_dedup_bulk for ids that are all new,
-- with plain INSERTs and no dedup look-up. An id queued, or remembered in ``dedup`` (within
-- the window or expired and not yet purged), or repeated in the batch breaks a primary key:
-- the statement then fails whole, having changed nothing, and the store sends the batch
-- through insert_dedup_bulk, which refuses just those. ON CONFLICT's speculative insertion
-- on both tables and the per-entry probe of ``dedup`` were about 40 % of the server's work
-- per row of a bulk load (PostgreSQL manual, INSERT, "ON CONFLICT Clause").
WITH {_bulk_entry}, {_purge_dedup}
), inserted AS (
    {_bulk_messages}
    ORDER BY e.ord
    RETURNING id
)
INSERT INTO {s}.dedup (queue, id, expires)
SELECT $1, i.id, extract(epoch from now())::float8 + $6::float8
FROM inserted i

-- name: insert_dedup_bulk
-- insert_dedup for a bulk load (a Spark write): every entry has a user id, the same headers
-- ($4) and delay ($5), and none is a put-back. Two arrays instead of seven to encode, send
-- and unnest, and no join to find which inserted ids to remember (all of them); the checks
-- and effects are those of insert_dedup. $6 is the window.
WITH {_bulk_entry}, {_purge_dedup}
), inserted AS (
    {_bulk_messages}
    WHERE (SELECT d.expires > extract(epoch from now())::float8 FROM {s}.dedup d
           WHERE d.queue = $1 AND d.id = e.id) IS NOT TRUE
    ORDER BY e.ord
    ON CONFLICT DO NOTHING
    RETURNING id
), remembered AS (
    INSERT INTO {s}.dedup (queue, id, expires)
    SELECT $1, i.id, extract(epoch from now())::float8 + $6::float8
    FROM inserted i
    ON CONFLICT (queue, id) DO UPDATE SET expires = EXCLUDED.expires
)
SELECT id FROM inserted

-- name: _pick
-- The take of get and reserve, up to $2 ready messages (mature now, a lapsed reservation
-- too), highest priority first, then by (mature, seq), skipping rows other consumers hold
-- locked: four CTEs, the first three each one ordered index range. ``hi`` (priority > 0)
-- and ``lo`` (< 0) walk the partial index messages_by_priority, which only prioritized rows
-- enter; ``plain`` (0) walks messages_by_mature as a queue without priorities always did,
-- for what ``hi`` left of $2 (a LIMIT of 0 does not run its scan). So a queue that never had
-- a priority pays one probe of an index with no entries of its own before its usual range,
-- and another after it only when that range held fewer than $2. The walks this leaves:
-- ``hi`` and ``lo`` step over the entries of not-yet-mature (delayed, reserved) rows of the
-- priorities above the ones they take (index entries only: mature is in the key), and
-- ``plain`` over ready rows of other priorities older than the plain ones it takes (a
-- backlog of negative ones; positive ones only while another take holds them), reading
-- each of those rows. Each is MATERIALIZED so it runs once, locking exactly the rows it
-- returns (see get).
hi AS MATERIALIZED (
    SELECT id, priority, mature, seq FROM {s}.messages
    WHERE queue = $1 AND priority > 0 AND mature <= extract(epoch from now())::float8
    ORDER BY priority DESC, mature, seq
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), plain AS MATERIALIZED (
    SELECT id, priority, mature, seq FROM {s}.messages
    WHERE queue = $1 AND mature <= extract(epoch from now())::float8
      -- "priority = 0", written so that the planner's estimate of the range stays what it
      -- was: with no statistics of the column yet (a new table, one just upgraded,
      -- autovacuum off) it takes "priority = 0" for one row in 200 (a CASE for one in
      -- two) and sorts the whole ready range rather than walk the index; an IS NOT NULL
      -- of an expression it takes for 199 in 200, statistics or not (PostgreSQL source,
      -- selfuncs.c: nulltestsel, DEFAULT_NOT_UNK_SEL)
      AND (CASE WHEN priority = 0 THEN true END) IS NOT NULL
    ORDER BY mature, seq
    LIMIT $2 - (SELECT count(*) FROM hi)
    FOR UPDATE SKIP LOCKED
), lo AS MATERIALIZED (
    SELECT id, priority, mature, seq FROM {s}.messages
    WHERE queue = $1 AND priority < 0 AND mature <= extract(epoch from now())::float8
    ORDER BY priority DESC, mature, seq
    LIMIT $2 - (SELECT count(*) FROM hi) - (SELECT count(*) FROM plain)
    FOR UPDATE SKIP LOCKED
), pick AS MATERIALIZED (
    -- LIMIT: a no-op, which tells the planner how few rows come (else it may join the
    -- update or delete to them by a hash over the whole queue, not a primary-key probe each)
    SELECT * FROM hi UNION ALL SELECT * FROM plain UNION ALL SELECT * FROM lo LIMIT $2

-- name: get
-- Pop: delete what the take (_pick above) locked, highest priority first, then earliest
-- first. Each CTE of the take is MATERIALIZED: a ``LIMIT ... FOR UPDATE SKIP LOCKED``
-- subquery inlined into the DELETE may be evaluated more than once by some plans (a rescan
-- skips nothing it locked itself, so it can match other rows), and the DELETE would then
-- remove rows it never returns. A materialized CTE is computed exactly once (PostgreSQL manual, "WITH
-- Queries": MATERIALIZED), so the statement deletes exactly the rows it locked and returns.
-- next_mature comes in the same round trip: the statement's snapshot still sees the
-- deleted rows, so they are excluded by id. It is looked up only when fewer than $2 were
-- taken: a full batch means "maybe more now" (NULL), and the queue layer needs no more (a
-- scalar subquery in a CASE branch not taken is not run). One row with a NULL id when
-- nothing was taken. The next mature time is returned as seconds from the server's now
-- (next_in): the client sleeps toward it on its own clock, which may be off the server's.
WITH {_pick}
), taken AS (
    DELETE FROM {s}.messages m
    USING pick
    WHERE m.queue = $1 AND m.id = pick.id
      -- a row still reserved has a lapsed reservation: history counts its try (see the
      -- history trigger, migrations/008_history_lapsed_try.sql)
      AND (SELECT set_config('keuss.lapsed_try', 'on', true)) IS NOT NULL
    RETURNING m.id, m.payload, m.headers, m.tries + m.reserved::int AS tries, m.mature, m.seq,
              m.priority
), next AS (
    SELECT CASE WHEN (SELECT count(*) FROM taken) < $2 THEN (
        SELECT mature FROM {s}.messages
        WHERE queue = $1 AND id NOT IN (SELECT id FROM taken)
        ORDER BY mature, seq
        LIMIT 1
    ) END AS next_mature
)
SELECT t.id, t.payload, t.headers, t.tries, t.mature,
    n.next_mature - extract(epoch from now())::float8 AS next_in, t.priority
FROM next n LEFT JOIN taken t ON true
ORDER BY t.priority DESC, t.mature, t.seq

-- name: reserve
-- Reserve: what the take (_pick above) locked gets mature = server now + $3 (its deadline)
-- and reserved = true (its CTEs are MATERIALIZED for the reason given at pop); one whose
-- earlier reservation expired counts that delivery as a try; next_mature as at pop.
-- Consumers see the mature time the message had before (when it became deliverable).
WITH {_pick}
), held AS (
    UPDATE {s}.messages m
    SET mature = extract(epoch from now())::float8 + $3::float8,
        tries = m.tries + m.reserved::int,
        reserved = true
    FROM pick
    WHERE m.queue = $1 AND m.id = pick.id {relax}
    RETURNING m.id, m.payload, m.headers, m.tries, pick.mature, pick.seq, m.priority
), next AS (
    SELECT CASE WHEN (SELECT count(*) FROM pick) < $2 THEN least(
        (SELECT mature FROM {s}.messages
         WHERE queue = $1 AND id NOT IN (SELECT id FROM pick)
         ORDER BY mature, seq LIMIT 1),
        CASE WHEN EXISTS (SELECT 1 FROM pick)
             THEN extract(epoch from now())::float8 + $3::float8 END
    ) END AS next_mature
)
SELECT h.id, h.payload, h.headers, h.tries, h.mature,
    n.next_mature - extract(epoch from now())::float8 AS next_in, h.priority
FROM next n LEFT JOIN held h ON true
ORDER BY h.priority DESC, h.mature, h.seq

-- name: commit
-- Commit: delete what is still reserved, with the tries the holder was given ($3[k], NULL =
-- any): a consumer whose reservation expired and went to someone else deletes nothing.
-- Answers each deleted id with the tries it had, from which the client tells which of the
-- requests naming it was the holder's (a batch may hold a stale holder's ok beside it).
DELETE FROM {s}.messages m
USING unnest($2::text[], $3::int4[]) AS a(id, tries)
WHERE m.queue = $1 AND m.id = a.id AND m.reserved
  AND (a.tries IS NULL OR m.tries = a.tries) {relax}
RETURNING m.id, m.tries

-- name: extend
-- Extend: what is still reserved by its holder (the guard of a commit: $3[k] the tries the
-- holder was given, NULL = any) gets mature = server now + $4[k], its new deadline; tries
-- and reserved stay, so a lapsed reservation nobody took since is extended as it was and a
-- later ok of its holder still matches. The guarded rows are locked first and the guard
-- evaluated again on a row a concurrent reserve or commit changed meanwhile (PostgreSQL
-- manual, SELECT: "The Locking Clause"), so a holder whose message was taken by another
-- consumer cannot take it back. An UPDATE joined to several rows for one target row takes
-- one of them at random (manual, UPDATE: "from_item"), so a batch naming an id twice is cut
-- to the last request whose guard holds, as if the requests ran in order. Answers each
-- extended id with its tries, from which the client tells which requests held.
WITH ext AS (
    SELECT e.* FROM unnest($2::text[], $3::int4[], $4::float8[])
           WITH ORDINALITY AS e(id, tries, seconds, ord)
), guarded AS MATERIALIZED (
    SELECT m.id, e.seconds, e.ord
    FROM {s}.messages m JOIN ext e ON m.queue = $1 AND m.id = e.id
    WHERE m.reserved AND (e.tries IS NULL OR m.tries = e.tries) {relax}
    FOR UPDATE OF m
), last AS (
    SELECT DISTINCT ON (g.id) g.id, g.seconds FROM guarded g ORDER BY g.id, g.ord DESC
)
UPDATE {s}.messages m
SET mature = extract(epoch from now())::float8 + l.seconds
FROM last l
WHERE m.queue = $1 AND m.id = l.id
RETURNING m.id, m.tries

-- name: _move_rows
-- The one body of a move, used by move and by rollback's deadletter: each row of the CTE
-- "moving" (id, target, payload, headers, delay, tag) goes to queue target in place: tries
-- 0, mature now + delay, its payload replaced if one is given (NULL = keep), the headers
-- (JSON object text without the opening brace, NULL = none) merged into its own by
-- merged_headers, each key once; stored headers that are no JSON object have them added
-- as message.append_headers does (stored headers '{}', empty or of whitespace and braces only, as
-- another program may write them, take a new object: cutting the last byte of empty ones
-- was a negative length; JSON whitespace around the object is cut first), and renamed by
-- moved_id when the id is taken there. Answers the old and the new id of each message
-- moved, and the position of the request that moved it
-- ("moving" carries it as ord: read from RETURNING, not joined back, as the planner
-- expects one row of a CTE and a join back is a nested loop over the whole batch).
UPDATE {s}.messages m
SET queue = v.target,
    id = {s}.moved_id(v.target, m.id, v.tag),
    tries = 0, reserved = false,
    mature = extract(epoch from now())::float8 + v.delay,
    payload = coalesce(v.payload, m.payload),
    headers = CASE WHEN v.headers IS NULL THEN m.headers
              ELSE coalesce(
                  {s}.merged_headers(m.headers, v.headers),
                  CASE WHEN m.headers = '\x7b7d'::bytea
                            OR length(btrim(m.headers, '\x7b7d20090a0d'::bytea)) = 0
                            THEN '\x7b'::bytea || v.headers
                       ELSE substring(btrim(m.headers, '\x20090a0d'::bytea)
                                      FROM 1 FOR length(btrim(m.headers, '\x20090a0d'::bytea)) - 1)
                            || '\x2c'::bytea || v.headers
                  END)
              END
FROM moving v
WHERE m.queue = $1 AND m.id = v.id
RETURNING v.id AS old_id, m.id AS new_id, v.ord

-- name: rollback
-- Rollback, and deadletter in the same statement. For each held message (same guard as a
-- commit) the failed-delivery count is tries + count_try. Past max_ko ($6, NULL = no
-- deadletter) it is moved to queue $7 by the move body above, with tag dl<failed> and the
-- headers x-dl-from-queue (from $8, which also opens x-dl-t), x-dl-t (server now in
-- Python's isoformat) and x-dl-tries. Others are released: reserved = false, mature = now
-- + delay. Answers the position in $2 of each request acted on with 1 (rolled back) or 2
-- (deadlettered).
WITH nack AS (
    SELECT n.* FROM unnest($2::text[], $3::int4[], $4::float8[], $5::bool[])
           WITH ORDINALITY AS n(id, tries, delay, count_try, ord)
), guarded AS MATERIALIZED (
    SELECT m.id, m.tries, n.delay, n.count_try, n.ord
    FROM {s}.messages m JOIN nack n ON m.queue = $1 AND m.id = n.id
    WHERE m.reserved AND (n.tries IS NULL OR m.tries = n.tries) {relax}
    FOR UPDATE OF m
), held AS MATERIALIZED (
    -- the first request whose guard holds: a stale holder's ko in the same batch is not it
    SELECT DISTINCT ON (g.id) g.id, g.ord, g.tries + g.count_try::int AS failed, g.delay,
           ($6::int4 IS NOT NULL AND g.count_try AND g.tries + 1 > $6::int4) AS dead
    FROM guarded g
    ORDER BY g.id, g.ord
), released AS (
    UPDATE {s}.messages m
    SET tries = h.failed, reserved = false,
        mature = extract(epoch from now())::float8 + h.delay
    FROM held h
    WHERE m.queue = $1 AND m.id = h.id AND NOT h.dead
    RETURNING h.ord
), moving AS (
    SELECT h.id, h.ord, $7::text AS target, NULL::bytea AS payload,
           $8::bytea || convert_to(
               to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS')
               || CASE WHEN extract(microseconds FROM now())::bigint % 1000000 = 0
                       THEN '' ELSE to_char(now() AT TIME ZONE 'UTC', '.US') END
               || '+00:00","x-dl-tries":' || h.failed || '}', 'UTF8') AS headers,
           0::float8 AS delay, 'dl' || h.failed AS tag
    FROM held h
    WHERE h.dead
), moved AS (
{_move_rows}
)
SELECT ord, 1 AS outcome FROM released UNION ALL SELECT ord, 2 FROM moved

-- name: move
-- Move held messages (same guard as a commit) to other queues of the schema, by the move
-- body above ($6[k]: the added headers, NULL = none; $8[k]: the rename tag). Answers the
-- new id and the position in $2 of each request acted on.
WITH mv AS (
    SELECT v.* FROM unnest($2::text[], $3::int4[], $4::text[], $5::bytea[], $6::bytea[],
                           $7::float8[], $8::text[])
           WITH ORDINALITY AS v(id, tries, target, payload, headers, delay, tag, ord)
), guarded AS MATERIALIZED (
    SELECT m.id, v.target, v.payload, v.headers, v.delay, v.tag, v.ord
    FROM {s}.messages m JOIN mv v ON m.queue = $1 AND m.id = v.id
    WHERE m.reserved AND (v.tries IS NULL OR m.tries = v.tries) {relax}
    FOR UPDATE OF m
), moving AS MATERIALIZED (
    -- the first request whose guard holds, as at rollback
    SELECT DISTINCT ON (g.id) g.* FROM guarded g ORDER BY g.id, g.ord
), moved AS (
{_move_rows}
)
SELECT new_id, ord FROM moved

-- name: remove
-- Remove: anything of the queue but an active reservation.
DELETE FROM {s}.messages
WHERE queue = $1 AND id = ANY($2::text[])
  AND NOT (reserved AND mature > extract(epoch from now())::float8)
  AND (SELECT set_config('keuss.lapsed_try', 'on', true)) IS NOT NULL  -- as at get
RETURNING id

-- name: amend
-- Amend (promote, reschedule, change_priority): change waiting messages where they stand,
-- in one statement for the whole batch ($2 ids, $3 delays, $4 priorities, $5 scheduled_only;
-- NULL delay or priority: that stays). A message is waiting by the rule of remove: anything
-- of the queue but an active reservation, so a lapsed reservation nobody took since counts
-- (changed, it is released as a reserve would count it: tries + 1, reserved false; its
-- holder's late ok, extend or ko then finds nothing). The rows are locked first, in order
-- of id (ORDER BY with a locking clause locks rows as they come out of the sort: PostgreSQL
-- manual, SELECT, "The Locking Clause"), so two amends sharing ids take turns rather than
-- deadlock, and a reserve skips them (SKIP LOCKED) or, having taken one first, leaves it
-- reserved, which the lock's re-check of the condition on the newest row version then
-- refuses (manual, "Read Committed Isolation Level"): never both. "now" is
-- clock_timestamp() read once the rows are locked, the time of the write itself (now(),
-- the transaction's start, would date a change that waited for a lock from before the
-- wait). The requests are applied per id in their order by a recursive walk, as if sent
-- one at a time: a scheduled_only one applies only while its message's mature time is
-- still ahead. seq stays, so within its priority a message keeps its place by (mature, seq)
-- as if pushed with it; a non-zero priority puts the row in messages_by_priority, as a
-- prioritized push does. An UPDATE fires no DELETE trigger: history records nothing.
-- Answers the position in $2 of each request that changed its message.
WITH RECURSIVE req AS (
    SELECT r.*, row_number() OVER (PARTITION BY r.id ORDER BY r.ord) AS k
    FROM unnest($2::text[], $3::float8[], $4::int2[], $5::bool[])
         WITH ORDINALITY AS r(id, delay, priority, scheduled_only, ord)
), locked AS MATERIALIZED (
    SELECT m.id, m.mature, m.priority FROM {s}.messages m
    WHERE m.queue = $1 AND m.id = ANY($2::text[])
      AND NOT (m.reserved AND m.mature > extract(epoch from clock_timestamp())::float8)
    ORDER BY m.id
    FOR UPDATE
), clock AS MATERIALIZED (
    -- read from the locked rows, so it runs once they are all locked
    SELECT extract(epoch from clock_timestamp())::float8 AS now
    FROM (SELECT count(*) FROM locked) l
), step AS (
    SELECT l.id, 0::int8 AS k, l.mature, l.priority, false AS ok FROM locked l
    UNION ALL
    SELECT s.id, r.k,
           CASE WHEN a.ok THEN coalesce(c.now + r.delay, s.mature) ELSE s.mature END,
           CASE WHEN a.ok THEN coalesce(r.priority, s.priority) ELSE s.priority END,
           a.ok
    FROM step s
    JOIN req r ON r.id = s.id AND r.k = s.k + 1
    CROSS JOIN clock c
    CROSS JOIN LATERAL (SELECT NOT r.scheduled_only OR s.mature > c.now AS ok) a
), final AS MATERIALIZED (
    SELECT DISTINCT ON (s.id) s.id, s.mature, s.priority FROM step s
    WHERE s.id IN (SELECT id FROM step WHERE ok)
    ORDER BY s.id, s.k DESC
), changed AS (
    UPDATE {s}.messages m
    SET mature = f.mature, priority = f.priority,
        tries = m.tries + m.reserved::int, reserved = false
    FROM final f
    WHERE m.queue = $1 AND m.id = f.id
    RETURNING m.id
)
SELECT r.ord FROM step s JOIN req r ON r.id = s.id AND r.k = s.k
WHERE s.ok AND s.id IN (SELECT id FROM changed)

-- name: sizes
SELECT count(*) FILTER (WHERE mature <= t.now) AS size,
       count(*) AS total,
       count(*) FILTER (WHERE mature > t.now AND NOT reserved) AS scheduled,
       count(*) FILTER (WHERE mature > t.now AND reserved) AS reserved
FROM {s}.messages, (SELECT extract(epoch from now())::float8 AS now) t
WHERE queue = $1

-- name: next_mature
SELECT mature FROM {s}.messages WHERE queue = $1 ORDER BY mature, seq LIMIT 1

-- name: peek
-- Look without taking: up to $5 messages in state $4 past the cursor ($2 mature, $3 seq), in
-- the order of the (queue, mature, seq) index, which the row comparison walks. Scheduled and
-- reserved messages are all past now, so their walk starts there.
SELECT id, payload, headers, tries, mature, seq, reserved, t.now, priority
FROM {s}.messages, (SELECT extract(epoch from now())::float8 AS now) t
WHERE queue = $1 AND (mature, seq) > ($2::float8, $3::int8)
  AND mature > CASE WHEN $4::text IN ('scheduled', 'reserved') THEN t.now
                    ELSE '-infinity'::float8 END
  AND CASE $4::text WHEN 'ready' THEN mature <= t.now
                    WHEN 'scheduled' THEN NOT reserved
                    WHEN 'reserved' THEN reserved
                    ELSE true END
ORDER BY mature, seq
LIMIT $5

-- name: locate
SELECT id, payload, headers, tries, mature, seq, reserved, extract(epoch from now())::float8,
       priority
FROM {s}.messages
WHERE queue = $1 AND id = ANY($2::text[])

-- name: hold
-- Reserve given messages (requeue): as reserve does, but by id, and only those not under an
-- active reservation; a concurrent reserve skips the rows this statement has locked.
UPDATE {s}.messages
SET mature = extract(epoch from now())::float8 + $3::float8,
    tries = tries + reserved::int,
    reserved = true
WHERE queue = $1 AND id = ANY($2::text[])
  AND NOT (reserved AND mature > extract(epoch from now())::float8)
RETURNING id, tries

-- History (history=True): see migrations/006_history.sql (and 008, 014).

-- name: history_on
-- Install the trigger that keeps what is deleted from messages; once per schema (a trigger
-- made concurrently by another client is fine).
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgname = 'keep_history' AND tgrelid = '{s}.messages'::regclass) THEN
        CREATE TRIGGER keep_history AFTER DELETE ON {s}.messages
        REFERENCING OLD TABLE AS gone
        FOR EACH STATEMENT EXECUTE FUNCTION {s}.keep_history();
    END IF;
EXCEPTION WHEN duplicate_object THEN NULL;
END $$

-- name: history
-- Processed in [$2, $3), past the cursor ($4 processed, $5 seq), at most $6.
SELECT id, payload, headers, tries, processed, seq, priority
FROM {s}.history
WHERE queue = $1 AND processed >= $2::float8 AND processed < $3::float8
  AND (processed, seq) > ($4::float8, $5::int8)
ORDER BY processed, seq
LIMIT $6

-- name: locate_history
-- The latest record of each id.
SELECT DISTINCT ON (id) id, payload, headers, tries, processed, seq, priority
FROM {s}.history
WHERE queue = $1 AND id = ANY($2::text[])
ORDER BY id, processed DESC, seq DESC

-- name: forget_history
-- A popped message put back (its caller was cancelled): drop the record its pop left, the
-- latest of its id.
DELETE FROM {s}.history h
USING (SELECT DISTINCT ON (id) processed, seq FROM {s}.history
       WHERE queue = $1 AND id = ANY($2::text[])
       ORDER BY id, processed DESC, seq DESC) l
WHERE h.queue = $1 AND h.processed = l.processed AND h.seq = l.seq

-- name: expire_history
-- Delete up to $2 records older than $1 seconds; run again while it deletes $2.
DELETE FROM {s}.history
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {s}.history
    WHERE processed < extract(epoch from now())::float8 - $1::float8
    LIMIT $2))

-- The rate limiters ---------------------------------------------------------------------
-- A queue's limiter is one row of rate_limits; rate_take is contract.rate_step in one
-- statement on it: $1 queue, $2 interval (seconds per grant), $3 burst, $4 count (> 0 take,
-- < 0 give back, 0 none), $5 hold (seconds), $6 the reference's rounding slack, $7 a
-- give-back's end (the tat its take answered: only what is still ahead comes back). "now" is
-- clock_timestamp(), not the now() of the rest of this file: an upsert that finds the row
-- locked waits for the step holding it, and computes its SET after that step commits, so a
-- clock read there orders the steps of one row by time, and the wait it answers is counted
-- from the step itself, not from when the statement came in (now() is the transaction's
-- start: a step delayed behind others would see an earlier time than the step before it).
-- It is read once per evaluation of the step (a sub-SELECT with a volatile target list is
-- not flattened into its parent: it is one row, computed once).

-- name: _rate_step
-- The new state from prev(tat, held_until, refused), the old one: the columns stepped,
-- held_until, tat, granted and refused (one more for a take granted fewer than it asked).
SELECT c.now AS stepped, u.held_until,
    CASE WHEN $4::int > 0 AND c.now >= u.held_until THEN t.tat + g.granted * $2::float8
         WHEN $4::int < 0 THEN greatest(
             t.tat - least(-$4::int * $2::float8, greatest(0, $7::float8 - c.now)), c.now)
         ELSE t.tat END AS tat,
    g.granted,
    prev.refused + CASE WHEN g.granted < $4::int THEN 1 ELSE 0 END AS refused
FROM (SELECT extract(epoch from clock_timestamp())::float8 AS now) c,
LATERAL (SELECT CASE WHEN $5::float8 > 0 THEN greatest(prev.held_until, c.now + $5::float8)
                     ELSE prev.held_until END AS held_until) u,
LATERAL (SELECT greatest(prev.tat, c.now) AS tat) t,
LATERAL (SELECT CASE WHEN $4::int > 0 AND c.now >= u.held_until
    THEN greatest(0, least($4::int, floor(
        (c.now + $3::int * $2::float8 - t.tat) / $2::float8 + $6::float8)))::int
    ELSE 0 END AS granted) g

-- name: rate_take
-- One step of queue $1's limiter: a first step inserts the row (from the state of none),
-- any later one updates it under its row lock (ON CONFLICT DO UPDATE), so concurrent steps
-- of every process take turns on it. Answers granted, and wait: the seconds from the step
-- until the next grant falls due (0: one is due already).
INSERT INTO {s}.rate_limits AS r (queue, stepped, held_until, tat, granted, refused)
SELECT $1, n.stepped, n.held_until, n.tat, n.granted, n.refused
FROM (SELECT 0::float8 AS tat, 0::float8 AS held_until, 0::bigint AS refused) prev,
    LATERAL ({_rate_step}) n
ON CONFLICT (queue) DO UPDATE SET (stepped, held_until, tat, granted, refused) = (
    SELECT n.stepped, n.held_until, n.tat, n.granted, n.refused
    FROM (SELECT r.tat, r.held_until, r.refused) prev, LATERAL ({_rate_step}) n
)
RETURNING r.granted, greatest(0, r.held_until - r.stepped,
    r.tat - ($3::int - 1) * $2::float8 - r.stepped) AS wait, r.tat, r.refused

-- name: rate_reclaim
-- Drop up to $1 limiter rows whose two times are past: such a row is the state of none,
-- and the queue's next step makes it again. Run now and then by the clients that step
-- limiters (PostgresBackend.rate_take), off the steps' path: a queue gone idle leaves no
-- row for ever. The time is checked again in the DELETE's own condition, not only where
-- the rows are picked: a row a step updated meanwhile is checked against that condition
-- in the state the step left (PostgreSQL manual, "Read Committed Isolation Level"), so a
-- row just stepped ahead stays; a step that finds its row gone inserts it again (INSERT ...
-- ON CONFLICT ends in an insert or an update). No index on the times: every step moves
-- them, and an indexed column updated makes every update write index entries (no HOT
-- update); the pick reads the table, one small row per rate-limited queue.
DELETE FROM {s}.rate_limits
WHERE queue = ANY(ARRAY(
    SELECT queue FROM {s}.rate_limits
    WHERE greatest(tat, held_until) < extract(epoch from clock_timestamp())::float8
    LIMIT $1))
  AND greatest(tat, held_until) < extract(epoch from clock_timestamp())::float8

-- The stats store ----------------------------------------------------------------------
-- Counters are buffered in the client and written as one upsert per flush, whatever the
-- number of queues and counters in it.

-- name: stats_apply
-- Flush number $5 of the stats store $4: applied only if its number is past the last one
-- that store had applied (a flush whose reply was lost is sent again with its number, and
-- is then applied once, whether or not the server had it). One statement: the number and
-- the counters commit together.
WITH flush AS (
    INSERT INTO {s}.stats_flushes AS f (origin, seq, at) VALUES ($4, $5, now())
    ON CONFLICT (origin) DO UPDATE SET seq = EXCLUDED.seq, at = EXCLUDED.at
    WHERE f.seq < EXCLUDED.seq
    RETURNING 1
)
INSERT INTO {s}.stats (queue, counter, value)
SELECT c.queue, c.counter, c.value
FROM unnest($1::text[], $2::text[], $3::int8[]) AS c(queue, counter, value)
WHERE EXISTS (SELECT 1 FROM flush)
ON CONFLICT (queue, counter) DO UPDATE SET value = stats.value + EXCLUDED.value

-- name: stats_flushed
-- The number of the last flush stats store $1 had applied (NULL: none).
SELECT seq FROM {s}.stats_flushes WHERE origin = $1

-- name: stats_forget_flushes
-- A stats store closing with nothing unsettled ($1), and those silent for a week (NULL).
DELETE FROM {s}.stats_flushes
WHERE origin = $1 OR ($1 IS NULL AND at < now() - interval '7 days')

-- name: stats_counters
SELECT counter, value FROM {s}.stats WHERE queue = $1

-- name: stats_reset
DELETE FROM {s}.stats WHERE queue = $1

-- name: stats_set_paused
INSERT INTO {s}.queues (queue, paused) VALUES ($1, $2)
ON CONFLICT (queue) DO UPDATE SET paused = EXCLUDED.paused

-- name: stats_is_paused
SELECT paused FROM {s}.queues WHERE queue = $1

-- name: stats_save_options
INSERT INTO {s}.queues (queue, options) VALUES ($1, $2::text::jsonb)
ON CONFLICT (queue) DO UPDATE SET options = EXCLUDED.options

-- name: stats_keep_options
-- Record a queue's options unless some are recorded ('{}': a row made by a pause only).
INSERT INTO {s}.queues (queue, options) VALUES ($1, $2::text::jsonb)
ON CONFLICT (queue) DO UPDATE SET options = EXCLUDED.options
WHERE {s}.queues.options = '{}'::jsonb

-- name: stats_queues
SELECT queue, options::text FROM {s}.queues ORDER BY queue

-- name: stats_save_pipeline
INSERT INTO {s}.pipelines (name, topology) VALUES ($1, $2::text::jsonb)
ON CONFLICT (name) DO UPDATE SET topology = EXCLUDED.topology, saved_at = clock_timestamp()

-- name: stats_keep_pipeline
-- Record a pipeline's topology unless one is recorded; the one recorded after. DO UPDATE
-- (to the same value) rather than DO NOTHING: it locks the row and RETURNING gives the row
-- in place, a conflicting insert committed after this statement's snapshot included
-- (PostgreSQL manual, INSERT: "ON CONFLICT Clause").
INSERT INTO {s}.pipelines (name, topology) VALUES ($1, $2::text::jsonb)
ON CONFLICT (name) DO UPDATE SET topology = {s}.pipelines.topology
RETURNING topology::text

-- name: stats_pipelines
SELECT name, topology::text FROM {s}.pipelines ORDER BY name

-- name: stats_remove_pipeline
DELETE FROM {s}.pipelines WHERE name = $1

-- The result store ---------------------------------------------------------------------
-- One row of results per (queue, id): see migrations/013_results.sql. $1 is always the
-- queue name. A put reads clock_timestamp(), the time of the write itself; the reads use
-- now() (the statement's start: each runs in a transaction of its own), which, being
-- stable, can be an index condition (a volatile clock cannot).

-- name: results_put
-- Store each ($2 id, $3 body) of queue $1, expiring $4 seconds after it is written, on the
-- server's clock, replacing a result kept under the same id (and its expiry). The ids are
-- distinct (ON CONFLICT DO UPDATE cannot update a row twice in one statement): the caller
-- keeps the last of each.
INSERT INTO {s}.results (queue, id, body, expires)
SELECT $1, p.id, p.body, clock_timestamp() + make_interval(secs => $4::float8)
FROM unnest($2::text[], $3::bytea[]) AS p(id, body)
ON CONFLICT (queue, id) DO UPDATE SET body = EXCLUDED.body, expires = EXCLUDED.expires

-- name: results_replace
-- For each ($2 id, $3 old, $4 new) of queue $1: where the unexpired body of id is old, it
-- becomes new, expiring $5 seconds after it is written (a compare-and-set: the row is
-- locked as it is updated, and a put committed meanwhile is re-read before the body is
-- compared, PostgreSQL manual, "Transaction Isolation", READ COMMITTED). The ids are
-- distinct: the caller keeps the last of each.
UPDATE {s}.results AS r
SET body = p.new, expires = clock_timestamp() + make_interval(secs => $5::float8)
FROM unnest($2::text[], $3::bytea[], $4::bytea[]) AS p(id, old, new)
WHERE r.queue = $1 AND r.id = p.id AND r.body = p.old AND r.expires > now()

-- name: results_get
-- The unexpired results of ids $2 of queue $1 (an id without one has no row).
SELECT id, body FROM {s}.results
WHERE queue = $1 AND id = ANY($2::text[]) AND expires > now()

-- name: results_expire
-- Delete up to $1 expired results, the oldest first; run again while it deletes $1. The
-- rows are picked by the expiry index, then deleted by their address (ctid). Rows another
-- client is writing (a put replacing one) are skipped, not waited for; the rows picked
-- are locked (FOR UPDATE), so none is put again between the pick and the delete, and a
-- row put again just before the pick is seen with its new expiry (the lock re-reads the
-- row's newest version: PostgreSQL manual, "Transaction Isolation", READ COMMITTED).
DELETE FROM {s}.results
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {s}.results
    WHERE expires <= now()
    ORDER BY expires
    LIMIT $1
    FOR UPDATE SKIP LOCKED))

-- The signal bus ----------------------------------------------------------------------

-- name: signal_notify
-- $1 the schema's channel, $2 the event.
SELECT pg_notify($1, $2)

-- The bucket storage (bucket-postgres) -------------------------------------------------
-- $1 is always the queue name. Times come from the caller (the bucket engine's clock).

-- name: buckets_insert
-- $2.. one array per column. A bucket whose id is stored already is left as it is: a
-- deadletter copy written again (its id is its slot's), or a retry.
INSERT INTO {s}.buckets (queue, id, score, count, remaining, blob, state)
SELECT $1, b.id, b.score, b.count, b.count, b.blob, b.state
FROM unnest($2::text[], $3::float8[], $4::int4[], $5::bytea[], $6::bytea[])
     AS b(id, score, count, blob, state)
ON CONFLICT (queue, id) DO NOTHING

-- name: buckets_lease
-- $2 token, $3 now, $4 deadline, $5 want, $6 max buckets, $7 ids left out (those the
-- leasing store still has in memory: never taken, nor counted in the lowest score left).
-- Candidates are locked (skipping
-- ones another lease holds), then the oldest are kept until their remaining messages cover
-- want. Locking CTEs are MATERIALIZED so they are evaluated exactly once whatever plan is
-- chosen: a lease updates exactly the buckets it returns. One row per leased bucket plus
-- the lowest score left; a single row with a NULL id when nothing was leased.
WITH candidate AS MATERIALIZED (
    SELECT id, score, owner, remaining FROM {s}.buckets
    WHERE queue = $1 AND score <= $3 AND id <> ALL($7::text[])
    ORDER BY score, id
    LIMIT $6
    FOR UPDATE SKIP LOCKED
), pick AS (
    SELECT id, score, owner FROM (
        SELECT id, score, owner,
               sum(remaining) OVER (ORDER BY score, id) - remaining AS before,
               row_number() OVER (ORDER BY score, id) AS n
        FROM candidate
    ) c
    WHERE before < $5 OR n = 1
), leased AS (
    UPDATE {s}.buckets b SET owner = $2, score = $4, seq = 0
    FROM pick
    WHERE b.queue = $1 AND b.id = pick.id
    RETURNING b.id, b.blob, b.state, pick.owner AS previous, pick.score AS old_score
), rest AS (
    SELECT min(score) AS low FROM {s}.buckets
    WHERE queue = $1 AND id NOT IN (SELECT id FROM pick) AND id <> ALL($7::text[])
)
SELECT l.id, l.blob, l.state, l.previous, r.low
FROM rest r LEFT JOIN leased l ON true
ORDER BY l.old_score, l.id

-- name: buckets_lease_ids
-- $2 token, $3 now, $4 deadline, $5 ids: the free ones, or those whose lease expired.
WITH pick AS MATERIALIZED (
    SELECT id, owner FROM {s}.buckets
    WHERE queue = $1 AND id = ANY($5::text[]) AND (owner = '' OR score <= $3)
    FOR UPDATE SKIP LOCKED
)
UPDATE {s}.buckets b SET owner = $2, score = $4, seq = 0
FROM pick
WHERE b.queue = $1 AND b.id = pick.id
RETURNING b.id, b.blob, b.state, pick.owner AS previous

-- name: buckets_write
-- $2.. one array per field of a state write, $2 the owner each is conditioned on (the
-- token of the lease it was made under), $8 its number in that lease: only rows still
-- owned by it, and only past the number stored. One row per write of a row still owned by
-- its lease, with the number stored after it: the write's own (written, or this very write
-- was already) or a larger one (refused: a later write of the lease is stored; the row is
-- left as it was, a stale delete included). No row: the lease is over. Settled in the
-- update itself, not read beside it: under READ COMMITTED an update waiting for another
-- one's row lock checks its condition again on the row that one left, which a plain read
-- of the same statement does not see (PostgreSQL manual, "Read Committed Isolation Level").
WITH w AS (
    SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::float8[], $6::int4[],
                         $7::bytea[], $8::int8[])
        AS w(owner, id, mode, score, remaining, state, seq)
), deleted AS (
    DELETE FROM {s}.buckets b USING w
    WHERE b.queue = $1 AND b.id = w.id AND b.owner = w.owner AND w.mode = 'd'
      AND b.seq < w.seq
    RETURNING b.id, w.seq
), updated AS (
    UPDATE {s}.buckets b
    SET score = CASE WHEN b.seq < w.seq THEN w.score ELSE b.score END,
        remaining = CASE WHEN b.seq < w.seq THEN w.remaining ELSE b.remaining END,
        state = CASE WHEN b.seq < w.seq THEN coalesce(w.state, b.state) ELSE b.state END,
        owner = CASE WHEN b.seq < w.seq AND w.mode = 'r' THEN '' ELSE b.owner END,
        seq = greatest(b.seq, w.seq)
    FROM w
    WHERE b.queue = $1 AND b.id = w.id AND b.owner = w.owner
      AND (w.mode <> 'd' OR b.seq >= w.seq)
    RETURNING b.id, b.seq
)
SELECT id, seq FROM deleted UNION ALL SELECT id, seq FROM updated

-- name: buckets_census
-- $2 now, $3 ids left out (the buckets this process holds in memory).
SELECT coalesce(sum(remaining) FILTER (WHERE score <= $2), 0),
       coalesce(sum(remaining) FILTER (WHERE score > $2 AND owner = ''), 0),
       coalesce(sum(remaining) FILTER (WHERE score > $2 AND owner <> ''), 0),
       min(score)
FROM {s}.buckets
WHERE queue = $1 AND id <> ALL($3::text[])
