-- A move appended the added headers to the stored ones (the JSON object text): a message
-- moved round a cyclic pipeline carried stored headers growing with every pass, though a
-- decode read the right values (a repeated key takes its last value, in its first place).
-- merged_headers merges instead, each key once, so that the text decodes to what the
-- appended text would: ``added`` is the added object's text without its opening brace, as
-- the move statement has it. Values keep their text (json_each of the json type, not
-- jsonb, which would rewrite numbers: PostgreSQL manual, "JSON Types"). NULL when the
-- stored headers are no JSON object (another program's, or empty: data_exception, class
-- 22 of "PostgreSQL Error Codes"); the caller appends to them then, as before.
-- Headers holding NUL anywhere (a key or a string value, written \u0000): json_each cannot
-- turn that escape into text ("unsupported Unicode escape sequence", SQLSTATE 22P05;
-- PostgreSQL manual, "JSON Types": \u0000 is refused where the text must be converted): a
-- plain json_each would fail there, and the move would append as before, the headers
-- growing again. So, only when the text holds \u0000, its escapes are renamed first, one
-- to one, with none left to refuse: \u0001 becomes \u0001\u0002 and \u0000 \u0001\u0003
-- (each token \uXXXX or \<char> read as one, so an escaped backslash before "u0000" is
-- left alone); the merged text (keys written again by to_json, which writes control
-- characters as \u00xx) is renamed back.
CREATE OR REPLACE FUNCTION {s}.json_nul_renamed(doc text, back boolean) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(string_agg(
        CASE WHEN NOT back AND r.m[1] = '\u0000' THEN '\u0001\u0003'
             WHEN NOT back AND r.m[1] = '\u0001' THEN '\u0001\u0002'
             WHEN back AND r.m[1] = '\u0001\u0003' THEN '\u0000'
             WHEN back AND r.m[1] = '\u0001\u0002' THEN '\u0001'
             ELSE r.m[1] END, '' ORDER BY r.n), '')
    FROM regexp_matches(
        doc,
        CASE WHEN back THEN '\\u0001\\u000[23]|\\u[0-9a-fA-F]{4}|\\.|[^\\]+'
             ELSE '\\u[0-9a-fA-F]{4}|\\.|[^\\]+' END,
        'g') WITH ORDINALITY AS r(m, n)
$$;
CREATE OR REPLACE FUNCTION {s}.merged_headers(stored bytea, added bytea) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    merged text;
    old text;
    new text;
    nul boolean;
BEGIN
    old := convert_from(stored, 'UTF8');  -- here, not in DECLARE: EXCEPTION catches it
    new := '{' || convert_from(added, 'UTF8');
    nul := strpos(old, '\u0000') > 0 OR strpos(new, '\u0000') > 0;
    IF nul THEN
        old := {s}.json_nul_renamed(old, false);
        new := {s}.json_nul_renamed(new, false);
    END IF;
    SELECT string_agg(to_json(m.key)::text || ':' || m.value, ',' ORDER BY m.place)
    INTO merged
    FROM (
        SELECT e.key, min(e.ord) AS place,
               (array_agg(e.value::text ORDER BY e.ord DESC))[1] AS value
        FROM (
            SELECT s.key, s.value, s.ord
            FROM json_each(old::json) WITH ORDINALITY AS s(key, value, ord)
            UNION ALL
            SELECT a.key, a.value, a.ord + 4294967296
            FROM json_each(new::json) WITH ORDINALITY AS a(key, value, ord)
        ) e
        GROUP BY e.key
    ) m;
    merged := '{' || coalesce(merged, '') || '}';
    IF nul THEN
        merged := {s}.json_nul_renamed(merged, true);
    END IF;
    RETURN convert_to(merged, 'UTF8');
EXCEPTION WHEN data_exception THEN
    RETURN NULL;
END
$$;
