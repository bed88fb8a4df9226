-- Step 2 declared moved_id STABLE, and a STABLE function reads the snapshot its calling
-- statement started with: two messages moved by one statement (a batch of ko's
-- deadlettering an id and its renamed twin) could be handed the same name, and the second
-- insert then failed. VOLATILE makes each call look at the table afresh, so it sees the
-- rows the statement has already moved there and names them in turn, as one by one would
-- (PostgreSQL manual, "Function Volatility Categories").
CREATE OR REPLACE FUNCTION {s}.moved_id(target text, base text, tag text) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
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
