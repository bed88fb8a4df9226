"""The Lua that merges added headers into stored ones, shared by the Redis stores' moves.

A move used to append the added members to the stored header object text: a message moved
round a cyclic pipeline carried stored headers growing with every pass, though a decode read
the right values (a repeated key takes its last value, in its first place). ``with_headers``
merges instead, each key once, so that the text decodes to what the appended text would.

It works on the JSON text, not through the ``cjson`` library Redis scripts have: cjson reads
numbers as Lua doubles (an int past 2**53 would change) and writes 14 significant digits by
default (lua-cjson manual, ``encode_number_precision``), and a header must come back
exactly as it went in. Values are kept as written; keys compare by their JSON text (the
client writes them with orjson, one spelling for each key). Stored text this cannot read as
an object (another program's) has the added members appended, as before.
"""

from __future__ import annotations

WITH_HEADERS = """
-- Skip JSON whitespace in ``s`` from ``i``: the position of the next other character.
local function json_skip(s, i)
  return string.find(s, '[^ \\t\\n\\r]', i)
end
-- The end of the JSON string opening at ``i`` in ``s`` (its closing quote), or nil.
local function json_string_end(s, i)
  local j = i + 1
  while true do
    local c = string.find(s, '["\\\\]', j)
    if not c then return nil end
    if string.sub(s, c, c) == '"' then return c end
    j = c + 2
  end
end
local FAST_STRING = '^("[^"\\\\]*")[ \\t\\n\\r]*:[ \\t\\n\\r]*("[^"\\\\]*")[ \\t\\n\\r]*([,}])'
local FAST_SCALAR = '^("[^"\\\\]*")[ \\t\\n\\r]*:[ \\t\\n\\r]*([%w%.%+%-]+)[ \\t\\n\\r]*([,}])'
-- The members of JSON object text ``s``: its keys (their JSON text) in order of first
-- appearance, and each key's last value text; nil when ``s`` is not an object read so.
local function json_members(s)
  local keys, values = {}, {}
  local i = json_skip(s, 1)
  if not i or string.sub(s, i, i) ~= '{' then return nil end
  i = json_skip(s, i + 1)
  if not i then return nil end
  if string.sub(s, i, i) == '}' then
    if json_skip(s, i + 1) then return nil end
    return keys, values
  end
  while true do
    -- The usual member at once (a key and a string or scalar value, no escapes, no
    -- nesting): one match, not a scan, since it runs for every member of every move.
    local _, last, key, value, sep = string.find(s, FAST_STRING, i)
    if not last then _, last, key, value, sep = string.find(s, FAST_SCALAR, i) end
    if last then
      if values[key] == nil then keys[#keys + 1] = key end
      values[key] = value
      if sep == '}' then
        if json_skip(s, last + 1) then return nil end
        return keys, values
      end
      i = json_skip(s, last + 1)
      if not i then return nil end
    else
    if string.sub(s, i, i) ~= '"' then return nil end
    local e = json_string_end(s, i)
    if not e then return nil end
    local key = string.sub(s, i, e)
    local colon = json_skip(s, e + 1)
    if not colon or string.sub(s, colon, colon) ~= ':' then return nil end
    local depth, p, stop = 0, colon + 1, nil
    while not stop do
      local c = string.find(s, '[",{}%[%]]', p)
      if not c then return nil end
      local ch = string.sub(s, c, c)
      if ch == '"' then
        local q = json_string_end(s, c)
        if not q then return nil end
        p = q + 1
      elseif ch == '{' or ch == '[' then
        depth = depth + 1
        p = c + 1
      elseif depth > 0 then  -- a closing bracket or a comma inside a nested value
        if ch == '}' or ch == ']' then depth = depth - 1 end
        p = c + 1
      elseif ch == ']' then
        return nil
      else
        stop = c  -- the ',' or '}' ending this member
      end
    end
    local value = string.sub(s, colon + 1, stop - 1)
    if not string.find(value, '[^ \\t\\n\\r]') then return nil end
    if values[key] == nil then keys[#keys + 1] = key end
    values[key] = value
    if string.sub(s, stop, stop) == '}' then
      if json_skip(s, stop + 1) then return nil end
      return keys, values
    end
    i = json_skip(s, stop + 1)
    if not i then return nil end
    end
  end
end
-- Header JSON ``headers`` with the members of ``added`` (JSON text without braces, '' =
-- none) merged in: each key once, in its first place, a repeated key taking the added
-- value. Stored text that is no object this reads (empty, or another program's) has them
-- appended: whitespace only, or an empty object, takes a new object; whitespace after the
-- closing brace is cut first.
local function with_headers(headers, added)
  if added == '' then return headers end
  headers = headers or ''
  local keys, values = json_members(headers)
  local new_keys, new_values = json_members('{' .. added .. '}')
  if keys and new_keys then
    for _, key in ipairs(new_keys) do
      if values[key] == nil then keys[#keys + 1] = key end
      values[key] = new_values[key]
    end
    local members = {}
    for n, key in ipairs(keys) do members[n] = key .. ':' .. values[key] end
    return '{' .. table.concat(members, ',') .. '}'
  end
  if headers == '{}' or headers == '' then return '{' .. added .. '}' end
  if string.sub(headers, -1) ~= '}' then headers = string.match(headers, '^(.-)%s*$') end
  if string.find(headers, '^%s*{?%s*}?$') then return '{' .. added .. '}' end
  return string.sub(headers, 1, -2) .. ',' .. added .. '}'
end
"""
"""Defines ``with_headers(headers, added)`` (and its helpers) for a script's prelude."""
