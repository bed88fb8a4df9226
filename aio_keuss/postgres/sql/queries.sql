-- The statements of the postgres store, one per primitive. {s} is the quoted schema;
-- {relax} is empty, or the condition that relaxes synchronous_commit (durable_acks=False).
-- $1 is always the queue name. "now" is extract(epoch from now()): the server's clock,
-- stable within the statement, usable as an index condition.

-- name: insert
-- Insert without user ids (generated ids, put-backs): no dedup table involved. A put-back
-- carries its own mature time and tries; others get now + delay.
INSERT INTO {s}.messages (queue, id, mature, tries, payload, headers)
SELECT $1, e.id, coalesce(e.mature, extract(epoch from now())::float8 + e.delay),
       e.tries, e.payload, e.headers
FROM unnest($2::text[], $3::bytea[], $4::bytea[], $5::float8[], $6::int4[], $7::float8[])
     WITH ORDINALITY AS e(id, payload, headers, delay, tries, mature, ord)
ORDER BY e.ord
ON CONFLICT DO NOTHING
RETURNING id

-- name: insert_dedup
-- Insert with some user-chosen ids ($8[k] true): an id remembered in ``dedup`` within the
-- window is refused even though its message is gone; a queued one is refused by the primary
-- key. Inserted user ids are remembered until now + window ($9). A hundred expired dedup
-- rows of the queue are purged on the way (never ones this statement touches).
WITH entry AS (
    SELECT * FROM unnest($2::text[], $3::bytea[], $4::bytea[], $5::float8[], $6::int4[],
                         $7::float8[], $8::bool[])
           WITH ORDINALITY AS e(id, payload, headers, delay, tries, mature, dedup, ord)
), expired AS MATERIALIZED (
    SELECT x.id FROM {s}.dedup x
    WHERE x.queue = $1 AND x.expires <= extract(epoch from now())::float8
      AND x.id <> ALL($2::text[])
    LIMIT 100 FOR UPDATE SKIP LOCKED
), purged AS (
    DELETE FROM {s}.dedup d
    USING expired x
    WHERE d.queue = $1 AND d.id = x.id
), inserted AS (
    INSERT INTO {s}.messages (queue, id, mature, tries, payload, headers)
    SELECT $1, e.id, coalesce(e.mature, extract(epoch from now())::float8 + e.delay),
           e.tries, e.payload, e.headers
    FROM entry e
    WHERE NOT (e.dedup AND EXISTS (
        SELECT 1 FROM {s}.dedup d
        WHERE d.queue = $1 AND d.id = e.id
          AND d.expires > extract(epoch from now())::float8))
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

-- name: get
-- Pop: delete up to $2 mature messages, earliest first, skipping rows other consumers hold
-- locked. The pick is MATERIALIZED: a ``LIMIT ... FOR UPDATE SKIP LOCKED`` subquery inlined
-- into the DELETE may be evaluated more than once by some plans (a rescan skips nothing it
-- locked itself, so it can match other rows), and the DELETE would then remove rows it
-- never returns. A materialized CTE is computed exactly once (PostgreSQL manual, "WITH
-- Queries": MATERIALIZED), so the statement deletes exactly the rows it locked and returns.
-- next_mature comes in the same round trip: the statement's snapshot still sees the
-- deleted rows, so they are excluded by id. One row with a NULL id when nothing was taken.
WITH pick AS MATERIALIZED (
    SELECT id FROM {s}.messages
    WHERE queue = $1 AND mature <= extract(epoch from now())::float8
    ORDER BY mature, seq
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), taken AS (
    DELETE FROM {s}.messages m
    USING pick
    WHERE m.queue = $1 AND m.id = pick.id
    RETURNING m.id, m.payload, m.headers, m.tries + m.reserved::int AS tries, m.mature, m.seq
), next AS (
    SELECT min(mature) AS next_mature FROM (
        SELECT mature FROM {s}.messages
        WHERE queue = $1 AND id NOT IN (SELECT id FROM taken)
        ORDER BY mature, seq
        LIMIT 1
    ) rest
)
SELECT t.id, t.payload, t.headers, t.tries, t.mature, n.next_mature
FROM next n LEFT JOIN taken t ON true
ORDER BY t.mature, t.seq

-- name: reserve
-- Reserve: up to $2 mature messages get mature = server now + $3 (their deadline) and
-- reserved = true (the pick is MATERIALIZED for the reason given at pop); one whose
-- earlier reservation expired counts that delivery as a try.
-- Consumers see the mature time the message had before (when it became deliverable).
WITH pick AS MATERIALIZED (
    SELECT id, mature, seq FROM {s}.messages
    WHERE queue = $1 AND mature <= extract(epoch from now())::float8 {relax}
    ORDER BY mature, seq
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), held AS (
    UPDATE {s}.messages m
    SET mature = extract(epoch from now())::float8 + $3::float8,
        tries = m.tries + m.reserved::int,
        reserved = true
    FROM pick
    WHERE m.queue = $1 AND m.id = pick.id
    RETURNING m.id, m.payload, m.headers, m.tries, pick.mature, pick.seq
), next AS (
    SELECT least(
        (SELECT mature FROM {s}.messages
         WHERE queue = $1 AND id NOT IN (SELECT id FROM pick)
         ORDER BY mature, seq LIMIT 1),
        CASE WHEN EXISTS (SELECT 1 FROM pick)
             THEN extract(epoch from now())::float8 + $3::float8 END
    ) AS next_mature
)
SELECT h.id, h.payload, h.headers, h.tries, h.mature, n.next_mature
FROM next n LEFT JOIN held h ON true
ORDER BY h.mature, h.seq

-- name: commit
-- Commit: delete what is still reserved, with the tries the holder was given ($3[k], NULL =
-- any): a consumer whose reservation expired and went to someone else deletes nothing.
DELETE FROM {s}.messages m
USING unnest($2::text[], $3::int4[]) AS a(id, tries)
WHERE m.queue = $1 AND m.id = a.id AND m.reserved
  AND (a.tries IS NULL OR m.tries = a.tries) {relax}
RETURNING m.id

-- name: rollback
-- Rollback, and deadletter in the same statement. For each held message (same guard as a
-- commit) the failed-delivery count is tries + count_try. Past max_ko ($6, NULL = no
-- deadletter) it moves to queue $7 in place: tries 0, mature now, headers appended as
-- message.append_headers does (x-dl-from-queue from $8, x-dl-t server now in Python's
-- isoformat, x-dl-tries), renamed by moved_id (tag dl<failed>) if the id is taken there,
-- the rule the move statement below follows too.
-- Others are released: reserved = false, mature = now + delay.
WITH nack AS (
    SELECT DISTINCT ON (n.id) n.* FROM unnest($2::text[], $3::int4[], $4::float8[], $5::bool[])
           WITH ORDINALITY AS n(id, tries, delay, count_try, ord)
    ORDER BY n.id, n.ord
), held AS MATERIALIZED (
    SELECT m.id, m.tries + n.count_try::int AS failed, n.delay,
           ($6::int4 IS NOT NULL AND n.count_try AND m.tries + 1 > $6::int4) AS dead
    FROM {s}.messages m JOIN nack n ON m.queue = $1 AND m.id = n.id
    WHERE m.reserved AND (n.tries IS NULL OR m.tries = n.tries) {relax}
    FOR UPDATE OF m
), released AS (
    UPDATE {s}.messages m
    SET tries = h.failed, reserved = false,
        mature = extract(epoch from now())::float8 + h.delay
    FROM held h
    WHERE m.queue = $1 AND m.id = h.id AND NOT h.dead
    RETURNING m.id, 1 AS outcome
), moved AS (
    UPDATE {s}.messages m
    SET queue = $7,
        id = {s}.moved_id($7, m.id, 'dl' || h.failed),
        tries = 0, reserved = false, mature = extract(epoch from now())::float8,
        headers = CASE WHEN m.headers = '\x7b7d'::bytea THEN '\x7b'::bytea
                       ELSE substring(m.headers FROM 1 FOR length(m.headers) - 1) || '\x2c'::bytea
                  END
                  || $8::bytea
                  || convert_to(
                       to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS')
                       || CASE WHEN extract(microseconds FROM now())::bigint % 1000000 = 0
                               THEN '' ELSE to_char(now() AT TIME ZONE 'UTC', '.US') END
                       || '+00:00","x-dl-tries":' || h.failed || '}', 'UTF8')
    FROM held h
    WHERE m.queue = $1 AND m.id = h.id AND h.dead
    RETURNING h.id, 2 AS outcome
)
SELECT id, outcome FROM released UNION ALL SELECT id, outcome FROM moved

-- name: move
-- Move held messages (same guard as a commit) to other queues of the schema in place:
-- queue, id (renamed by moved_id if taken there), tries 0, mature now + delay, the new
-- payload if given, the headers added to its own as message.append_headers does ($6[k]:
-- the added keys as JSON object text without the opening brace, NULL = none). Answers the
-- old and the new id of each message moved.
WITH mv AS (
    SELECT DISTINCT ON (v.id) v.* FROM unnest($2::text[], $3::int4[], $4::text[], $5::bytea[],
                                              $6::bytea[], $7::float8[], $8::text[])
           WITH ORDINALITY AS v(id, tries, target, payload, headers, delay, tag, ord)
    ORDER BY v.id, v.ord
), held AS MATERIALIZED (
    SELECT m.id, v.target, v.payload, v.headers, v.delay, v.tag
    FROM {s}.messages m JOIN mv v ON m.queue = $1 AND m.id = v.id
    WHERE m.reserved AND (v.tries IS NULL OR m.tries = v.tries) {relax}
    FOR UPDATE OF m
)
UPDATE {s}.messages m
SET queue = h.target,
    id = {s}.moved_id(h.target, m.id, h.tag),
    tries = 0, reserved = false,
    mature = extract(epoch from now())::float8 + h.delay,
    payload = coalesce(h.payload, m.payload),
    headers = CASE WHEN h.headers IS NULL THEN m.headers
                   WHEN m.headers = '\x7b7d'::bytea THEN '\x7b'::bytea || h.headers
                   ELSE substring(m.headers FROM 1 FOR length(m.headers) - 1) || '\x2c'::bytea
                        || h.headers
              END
FROM held h
WHERE m.queue = $1 AND m.id = h.id
RETURNING h.id AS old_id, m.id AS new_id

-- name: remove
-- Remove: anything of the queue but an active reservation.
DELETE FROM {s}.messages
WHERE queue = $1 AND id = ANY($2::text[])
  AND NOT (reserved AND mature > extract(epoch from now())::float8)
RETURNING id

-- name: sizes
SELECT count(*) FILTER (WHERE mature <= t.now) AS size,
       count(*) AS total,
       count(*) FILTER (WHERE mature > t.now AND NOT reserved) AS scheduled,
       count(*) FILTER (WHERE mature > t.now AND reserved) AS reserved
FROM {s}.messages, (SELECT extract(epoch from now())::float8 AS now) t
WHERE queue = $1

-- name: next_mature
SELECT mature FROM {s}.messages WHERE queue = $1 ORDER BY mature, seq LIMIT 1
