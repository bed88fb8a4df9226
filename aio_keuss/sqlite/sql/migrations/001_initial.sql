-- The first schema. ``seq`` is the rowid (an INTEGER PRIMARY KEY is its alias, SQLite
-- documentation "ROWID and the INTEGER PRIMARY KEY"): it breaks ties between equal mature
-- times, so messages due together leave in the order they came in, and a move (an UPDATE
-- of queue and id) keeps it. ``mature`` is float seconds since the epoch; a reserved
-- message's mature time is its reservation deadline, so an expired reservation is simply
-- mature again.
CREATE TABLE IF NOT EXISTS messages (
    seq      INTEGER PRIMARY KEY,
    queue    TEXT NOT NULL,
    id       TEXT NOT NULL,
    mature   REAL NOT NULL,
    tries    INTEGER NOT NULL DEFAULT 0,
    reserved INTEGER NOT NULL DEFAULT 0,
    payload  BLOB NOT NULL,
    headers  BLOB NOT NULL,
    UNIQUE (queue, id)
);
CREATE INDEX IF NOT EXISTS messages_by_mature ON messages (queue, mature, seq);

-- Ids the user chose, refused again until ``expires`` even once their message is gone.
CREATE TABLE IF NOT EXISTS dedup (
    queue   TEXT NOT NULL,
    id      TEXT NOT NULL,
    expires REAL NOT NULL,
    PRIMARY KEY (queue, id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS dedup_by_expires ON dedup (queue, expires);

CREATE TABLE IF NOT EXISTS stats (
    queue   TEXT NOT NULL,
    counter TEXT NOT NULL,
    value   INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (queue, counter)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS queues (
    queue   TEXT PRIMARY KEY,
    options TEXT NOT NULL DEFAULT '{}',
    paused  INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS pipelines (
    name     TEXT PRIMARY KEY,
    topology TEXT NOT NULL,
    saved_at REAL NOT NULL
) WITHOUT ROWID;

-- Signals to other processes: a row per event, read by those whose connection saw the
-- database change (PRAGMA data_version). AUTOINCREMENT: a reader remembers the last seq it
-- read, so a seq must never be handed out twice, even after the newest rows were pruned.
CREATE TABLE IF NOT EXISTS signals (
    seq     INTEGER PRIMARY KEY AUTOINCREMENT,
    at      REAL NOT NULL,
    payload TEXT NOT NULL
);
