-- The table of the bucket backend (bucket-postgres): whole buckets of messages, keyed by
-- (queue, id), leased by (queue, score, id). blob and state are stored uncompressed
-- (STORAGE EXTERNAL): compressing them would cost server CPU on every write for little
-- gain, and an UPDATE of state leaves the large, never-changing blob untouched.
-- The first release created this table, with the same definition, when bucket-postgres
-- first connected; the guard makes the step a no-op on such a schema.
DO $$ BEGIN
IF to_regclass('{s}.buckets') IS NULL THEN
CREATE TABLE {s}.buckets (
    queue     text NOT NULL,
    id        text NOT NULL,
    score     double precision NOT NULL,
    owner     text NOT NULL DEFAULT '',
    count     integer NOT NULL,
    remaining integer NOT NULL,
    blob      bytea NOT NULL,
    state     bytea NOT NULL,
    PRIMARY KEY (queue, id)
);
ALTER TABLE {s}.buckets ALTER COLUMN blob SET STORAGE EXTERNAL;
ALTER TABLE {s}.buckets ALTER COLUMN state SET STORAGE EXTERNAL;
CREATE INDEX buckets_by_score ON {s}.buckets (queue, score, id);
END IF;
END $$;
