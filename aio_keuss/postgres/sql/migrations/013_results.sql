-- Results of finished messages (queue option result_ttl): what a handler returned, or why
-- the message failed for good, kept under the message's id until expires (the server's
-- clock when it was put, plus the queue's result_ttl), for whoever waits for it in any
-- process. body is the queue layer's encoding, opaque here. A result put again under the
-- same id replaces the row (results_put). Expired rows are never read (results_get) and
-- are deleted by the connected clients, a bounded batch at a time (results_expire), found
-- through results_by_expires: times grow, so new entries land at the index's right edge.
CREATE TABLE IF NOT EXISTS {s}.results (
    queue   text NOT NULL,
    id      text NOT NULL,
    body    bytea NOT NULL,
    expires timestamptz NOT NULL,
    PRIMARY KEY (queue, id)
);
CREATE INDEX IF NOT EXISTS results_by_expires ON {s}.results (expires);
