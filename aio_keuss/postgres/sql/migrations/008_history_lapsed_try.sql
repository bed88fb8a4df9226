-- A pop or a remove of a message whose reservation lapsed recorded the tries from before
-- that delivery: ``tries`` does not count a running reservation (the next reserve adds it,
-- ``tries + reserved::int``, as the pop hands it on), and the record copied the column.
-- Such a row is still ``reserved`` (its deadline passed): the record now counts that try,
-- for the statements that say so by setting ``keuss.lapsed_try`` for their transaction
-- (get and remove, which delete a reserved row only once its reservation lapsed; not a
-- holder's ok, whose record keeps the count its holder was given, late or not). The
-- setting is cleared here, so that it stays with the statement that set it.
CREATE OR REPLACE FUNCTION {s}.keep_history() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    lapsed_try boolean := coalesce(current_setting('keuss.lapsed_try', true), '') = 'on';
BEGIN
    IF lapsed_try THEN
        PERFORM set_config('keuss.lapsed_try', '', true);
    END IF;
    INSERT INTO {s}.history (queue, id, processed, tries, payload, headers)
    SELECT queue, id, extract(epoch from now())::float8,
           tries + (lapsed_try AND reserved)::int, payload, headers
    FROM gone;
    RETURN NULL;
END
$$;
