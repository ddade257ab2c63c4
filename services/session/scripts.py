"""Lua scripts that make each session operation atomic inside Redis.

Every script touches the keys of one hash tag only (the keys of one session id, or one
owner's index), so each runs unchanged on a single Redis and on Redis Cluster. Replies
start with a status word the store turns into a domain error.
"""

from __future__ import annotations

# Every session script gets KEYS: the caller's meta, turns and requests of the session id, then
# the id's meta, turns and requests in the layout from before sessions were keyed by owner
# (keys.script_keys); ARGV[1] is the caller (its owner). All six share the id's hash tag.
#
# Upgrade prologue: a session stored in the old layout becomes its owner's on the owner's first
# use of it, moved (TTLs and all) into the owner's keys in the same script as the use, so a
# racing call sees it either there or here, never in both or in neither. Another owner's old
# session under the id is left alone and changes nothing this caller sees: the caller has its
# own namespace (keys.py), where the id is simply free or its own.
_ADOPT = """
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('HGET', KEYS[4], 'owner') == ARGV[1] then
  redis.call('RENAME', KEYS[4], KEYS[1])
  for i = 2, 3 do
    if redis.call('EXISTS', KEYS[i + 3]) == 1 then
      redis.call('RENAME', KEYS[i + 3], KEYS[i])
    else
      redis.call('DEL', KEYS[i])
    end
  end
end
"""

# Shared prologue: the session must exist in the caller's namespace. Its stored owner is still
# compared: under the caller's keys it can only differ if two owners' 128-bit key digests
# collided ('collision', never served), not because another tenant uses the id.
_ACCESS = (
    _ADOPT
    + """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then return {'missing'} end
if owner ~= ARGV[1] then return {'collision'} end
local ttl = redis.call('HGET', KEYS[1], 'ttl')
"""
)

# Sliding TTL: every read and write restarts the clock on all three keys.
_REFRESH = """
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
"""

# ARGV: owner, system_prompt, metadata_json, ttl, now_ms. A new session under an expired or
# deleted one's id starts with no turns and no request ids. 'exists' only for the caller's own
# session (an old-layout one included, moved first): another owner's is in another namespace.
CREATE = (
    _ADOPT
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists'} end
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'system_prompt', ARGV[2], 'metadata', ARGV[3],
  'version', '0', 'ttl', ARGV[4], 'created_at_ms', ARGV[5], 'updated_at_ms', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return {'ok', redis.call('HGETALL', KEYS[1]), 0}
"""
)

# ARGV: owner, max_turns (0 = all), before_request_id ('' = none). Reads the newest max_turns
# turns, or with a request id this session stored, the max_turns before its first turn, and
# that request's own turns; refreshes the TTL. Reply: 'ok', meta, turn count, the window's
# turns, the request's turns, and where the window ends (its turns' index past the last).
GET = (
    _ACCESS
    + _REFRESH
    + """
local count = redis.call('LLEN', KEYS[2])
local stop = count
local asked = {}
if ARGV[3] ~= '' then
  local stored = redis.call('HGET', KEYS[3], ARGV[3])
  if stored then
    local _, _, at, n = string.find(stored, '^%S+ (%d+) (%d+)$')
    if at then
      stop = tonumber(at)
      asked = redis.call('LRANGE', KEYS[2], stop, stop + tonumber(n) - 1)
    end
  end
end
local window = {}
if stop > 0 then
  local first = 0
  if tonumber(ARGV[2]) > 0 then first = math.max(0, stop - tonumber(ARGV[2])) end
  window = redis.call('LRANGE', KEYS[2], first, stop - 1)
end
return {'ok', redis.call('HGETALL', KEYS[1]), count, window, asked, stop}
"""
)

# ARGV: owner, expected_version ('' = any; "<version>@<created_at_ms>" = that version of the
# session created then), now_ms, max_turns, request_id ('' = none),
# request_digest, turn_json… The duplicate check, the version check, the limit check and the push
# happen in one step, so two writers holding the same version cannot both succeed, and a request
# id is stored once: again with the same digest (its non-assistant turns) it is a duplicate, with
# another it is refused ('reused'). A stored id keeps "digest first_index turn_count", so GET
# finds its turns without reading the others.
APPEND = (
    _ACCESS
    + """
if ARGV[5] ~= '' then
  local stored = redis.call('HGET', KEYS[3], ARGV[5])
  if stored and string.match(stored, '^(%S+)') ~= ARGV[6] then return {'reused'} end
  if stored then
"""
    + _REFRESH
    + """
    return {'duplicate', redis.call('HGETALL', KEYS[1]), redis.call('LLEN', KEYS[2])}
  end
end
local version = redis.call('HGET', KEYS[1], 'version')
local want_version, want_created = string.match(ARGV[2], '^(%d+)@(%d+)$')
if not want_version then want_version = ARGV[2] end
if want_created and want_created ~= redis.call('HGET', KEYS[1], 'created_at_ms') then
  return {'recreated', version}
end
if want_version ~= '' and want_version ~= version then return {'conflict', version} end
local count = redis.call('LLEN', KEYS[2])
local adding = #ARGV - 6
if count + adding > tonumber(ARGV[4]) then return {'full', count} end
for i = 7, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('HINCRBY', KEYS[1], 'version', 1)
if ARGV[5] ~= '' then redis.call('HSET', KEYS[3], ARGV[5], ARGV[6] .. ' ' .. count .. ' ' .. adding) end
redis.call('HSET', KEYS[1], 'updated_at_ms', ARGV[3])
"""
    + _REFRESH
    + """
return {'ok', redis.call('HGETALL', KEYS[1]), count + adding}
"""
)

# ARGV: owner.
TOUCH = (
    _ACCESS
    + _REFRESH
    + """
return {'ok', redis.call('HGETALL', KEYS[1]), redis.call('LLEN', KEYS[2])}
"""
)

# ARGV: owner.
DELETE = (
    _ACCESS
    + """
local created = redis.call('HGET', KEYS[1], 'created_at_ms') or ''
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return {'ok', created}
"""
)

# KEYS: owner index. ARGV: session_id, the deleted session's created_at_ms. Frees the deleted
# session's index entry only if it is still that session's (scored at its creation): a create of
# the same id between the delete and this release holds the entry now, and an unconditional ZREM
# hid that live session from ListSessions and from the per-owner limit.
RELEASE = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then redis.call('ZREM', KEYS[1], ARGV[1]) end
return 1
"""

# KEYS: owner index. ARGV: session_id, now_ms, max_sessions. Reserves a slot in the owner's
# index before the session is created, so the per-owner limit is checked and taken atomically.
# An id already there keeps its place: re-scored, a failed create of a live session (the router
# tries one for every version-0 turn) moved it to the end of ListSessions, whose pages then
# listed it twice. A created session's entry gets its creation time after the create (store.py).
RESERVE = """
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 1 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
"""

# KEYS: owner index. ARGV: after_score ('' = first page), after_member, count.
# Returns up to count (member, score) pairs ordered by (score, member) after the cursor.
PAGE = """
local out = {}
local min = '-inf'
local ties = 0
if ARGV[1] ~= '' then
  min = ARGV[1]
  ties = redis.call('ZCOUNT', KEYS[1], ARGV[1], ARGV[1])
end
local want = tonumber(ARGV[3])
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], min, '+inf', 'WITHSCORES', 'LIMIT', 0, want + ties)
for i = 1, #rows, 2 do
  if ARGV[1] == '' or tonumber(rows[i + 1]) > tonumber(ARGV[1]) or rows[i] > ARGV[2] then
    out[#out + 1] = rows[i]
    out[#out + 1] = rows[i + 1]
    if #out >= 2 * want then break end
  end
end
return out
"""
