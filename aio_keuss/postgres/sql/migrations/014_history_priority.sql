-- A record keeps the priority of the message it records, as mongo-history's does, so that a
-- replay pushes its copy at that priority (it pushed at 0). Records of earlier releases
-- read 0: a constant default is kept in the catalog, not written to each row (PostgreSQL
-- manual, ALTER TABLE), so adding the column does not rewrite the table. The function is
-- replaced in place: the trigger calling it (installed by history=True) stays as it is.
ALTER TABLE {s}.history ADD COLUMN IF NOT EXISTS priority smallint NOT NULL DEFAULT 0;
CREATE OR REPLACE FUNCTION {s}.keep_history() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    lapsed_try boolean := coalesce(current_setting('keuss.lapsed_try', true), '') = 'on';
BEGIN
    IF lapsed_try THEN
        PERFORM set_config('keuss.lapsed_try', '', true);
    END IF;
    INSERT INTO {s}.history (queue, id, processed, tries, payload, headers, priority)
    SELECT queue, id, extract(epoch from now())::float8,
           tries + (lapsed_try AND reserved)::int, payload, headers, priority
    FROM gone;
    RETURN NULL;
END
$$;
