-- The rate limiters of rate-limited queues (queue option rate_limit): one row per queue,
-- stepped by the one statement rate_take (queries.sql). tat (GCRA's theoretical arrival
-- time) and held_until are epoch seconds on the server's clock; a row whose both times are
-- past is the same as none, so it is left in place (one small row per rate-limited queue)
-- and simply stepped again. stepped and granted are the clock reading and the grant of the
-- last step: RETURNING sees only the new row (PostgreSQL 18 is the first with OLD there),
-- so the step's answer is read back from them.
CREATE TABLE IF NOT EXISTS {s}.rate_limits (
    queue      text PRIMARY KEY,
    tat        double precision NOT NULL,
    held_until double precision NOT NULL,
    stepped    double precision NOT NULL,
    granted    integer NOT NULL
);
