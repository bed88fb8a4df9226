-- The one rename rule of a moved message (Queue.move, deadletter): the first name not
-- taken in the destination queue among <id>, <id>.<tag>, <id>.<tag>.2, <id>.<tag>.3, ...
-- (Step 4 makes it VOLATILE: see there.)
CREATE OR REPLACE FUNCTION {s}.moved_id(target text, base text, tag text) RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    candidate text := base;
    clash integer := 0;
BEGIN
    WHILE EXISTS (SELECT 1 FROM {s}.messages m WHERE m.queue = target AND m.id = candidate) LOOP
        clash := clash + 1;
        candidate := base || '.' || tag || CASE WHEN clash > 1 THEN '.' || clash ELSE '' END;
    END LOOP;
    RETURN candidate;
END
$$;
