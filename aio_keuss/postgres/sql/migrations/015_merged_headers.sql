-- A move appended the added headers to the stored ones (the JSON object text): a message
-- moved round a cyclic pipeline carried stored headers growing with every pass, though a
-- decode read the right values (a repeated key takes its last value, in its first place).
-- merged_headers merges instead, each key once, so that the text decodes to what the
-- appended text would: ``added`` is the added object's text without its opening brace, as
-- the move statement has it. Values keep their text (json_each of the json type, not
-- jsonb, which would rewrite numbers: PostgreSQL manual, "JSON Types"). NULL when the
-- stored headers are no JSON object (another program's, or empty: data_exception, class
-- 22 of "PostgreSQL Error Codes"); the caller appends to them then, as before.
CREATE OR REPLACE FUNCTION {s}.merged_headers(stored bytea, added bytea) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    merged text;
BEGIN
    SELECT string_agg(to_json(m.key)::text || ':' || m.value, ',' ORDER BY m.place)
    INTO merged
    FROM (
        SELECT e.key, min(e.ord) AS place,
               (array_agg(e.value::text ORDER BY e.ord DESC))[1] AS value
        FROM (
            SELECT s.key, s.value, s.ord
            FROM json_each(convert_from(stored, 'UTF8')::json)
                 WITH ORDINALITY AS s(key, value, ord)
            UNION ALL
            SELECT a.key, a.value, a.ord + 4294967296
            FROM json_each(convert_from('\x7b'::bytea || added, 'UTF8')::json)
                 WITH ORDINALITY AS a(key, value, ord)
        ) e
        GROUP BY e.key
    ) m;
    RETURN convert_to('{' || coalesce(merged, '') || '}', 'UTF8');
EXCEPTION WHEN data_exception THEN
    RETURN NULL;
END
$$;
