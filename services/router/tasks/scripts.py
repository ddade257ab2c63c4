"""The Lua scripts that change a task atomically: create it (with admission), move its state."""

from __future__ import annotations

# Admission and creation of a task in one step: refused (nothing stored) when the tenant has
# ARGV[4] unfinished tasks already, or their requests with this one's would pass ARGV[11] bytes,
# or the work queue holds ARGV[5] entries (0 = no cap).
# With an idempotency key (KEYS[6]) that names a task still stored, that task is the answer and
# nothing is created; else the key is set to the new task in the same step. Claimed apart from
# the creation, two concurrent submits of one key (a client's retry while its first call is in
# flight) each found the other's claim without its task, took it as expired, and made two tasks.
# KEYS: hash, events, work queue, the tenant's open set, the tenant's open bytes[, idempotency
# key]. ARGV: now_ms, unfinished ttl seconds, events maxlen, per-tenant cap, queue cap, task id,
# event payload, the task hash key's text before and after a task id, the request's bytes, the
# per-tenant byte cap, then the hash's field/value pairs.
# Returns {1, 0, 0} when created, {0, 3, existing task id} for a known key, else {0, reason
# (1 tenant cap, 2 queue cap, 4 byte cap), count that hit the cap}.
CREATE_LUA = """
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
if KEYS[6] then
  local existing = redis.call('GET', KEYS[6])
  if existing and redis.call('EXISTS', ARGV[8] .. existing .. ARGV[9]) == 1 then
    return {0, 3, existing}
  end
end
-- An id older than the unfinished ttl names a task that expired without finishing (all routers
-- gone that long): it no longer counts.
local expired = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now - ttl * 1000)
for _, id in ipairs(expired) do redis.call('HDEL', KEYS[5], id) end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - ttl * 1000)
local per_tenant, queue_cap = tonumber(ARGV[4]), tonumber(ARGV[5])
if per_tenant > 0 then
  local open = redis.call('ZCARD', KEYS[4])
  if open >= per_tenant then return {0, 1, open} end
end
local size, byte_cap = tonumber(ARGV[10]), tonumber(ARGV[11])
if byte_cap > 0 then
  local held = size
  for _, n in ipairs(redis.call('HVALS', KEYS[5])) do held = held + tonumber(n) end
  if held > byte_cap then return {0, 4, held - size} end
end
if queue_cap > 0 then
  local queued = redis.call('XLEN', KEYS[3])
  if queued >= queue_cap then return {0, 2, queued} end
end
local fields = {}
for i = 12, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[3], '*', 'k', 'task', 'p', ARGV[7])
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('XADD', KEYS[3], '*', 'task_id', ARGV[6])
redis.call('ZADD', KEYS[4], now, ARGV[6])
redis.call('EXPIRE', KEYS[4], ttl)
redis.call('HSET', KEYS[5], ARGV[6], size)
redis.call('EXPIRE', KEYS[5], ttl)
if KEYS[6] then redis.call('SET', KEYS[6], ARGV[6], 'EX', ttl) end
return {1, 0, 0}
"""

# Compare-and-set of a task's state, with its event, in one step; a task reaching a final state
# leaves its tenant's open set in the same step.
# KEYS: hash, events, text, the tenant's open set, token ids, the tenant's open bytes. ARGV: allowed
# from-states (space separated),
# new state, now_ms, event payload ('' = none), expire seconds (0 = leave; set = a final state),
# events maxlen, reset text (0/1), task id, the run that must own the task ('' = any), then extra
# field/value pairs for the hash.
# Returns the state the task is in afterwards (-1 when it does not exist, -2 when another run owns
# it) and 1/0 for "changed". A final state drops what only a run reads (the request, up to 4 MiB,
# and the checkpoint): kept for the result's whole TTL, they held Redis for nobody.
TRANSITION_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {-1, 0} end
if ARGV[9] ~= '' and redis.call('HGET', KEYS[1], 'run') ~= ARGV[9] then return {-2, 0} end
if not string.find(' ' .. ARGV[1] .. ' ', ' ' .. state .. ' ', 1, true) then
  return {tonumber(state), 0}
end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'updated_ms', ARGV[3])
for i = 10, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[7] == '1' then
  redis.call('DEL', KEYS[3], KEYS[5])
  redis.call('HDEL', KEYS[1], 'checkpoint')
end
if ARGV[4] ~= '' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'k', 'task', 'p', ARGV[4])
end
if ARGV[5] ~= '0' then
  for _, i in ipairs({1, 2, 3, 5}) do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
  redis.call('ZREM', KEYS[4], ARGV[8])
  redis.call('HDEL', KEYS[6], ARGV[8])
  redis.call('HDEL', KEYS[1], 'request', 'checkpoint', 'run')
end
return {tonumber(ARGV[2]), 1}
"""

# A run's writes: each checks that the run still owns its task. A router paused past the
# visibility timeout (a VM pause, a blocked loop) came back writing into a task another router
# had taken over: two answers interleaved in one text, reported SUCCEEDED and growing after it.

# KEYS: hash, text, token ids, events. ARGV: run ('' = any), text, packed token ids, event payload,
# ttl seconds, events maxlen. Returns 1, or 0 when another run owns the task (nothing written).
APPEND_DELTA_LUA = """
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'run') ~= ARGV[1] then return 0 end
redis.call('APPEND', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('APPEND', KEYS[3], ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[5])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'k', 'delta', 'p', ARGV[4])
return 1
"""

# KEYS: hash. ARGV: run ('' = any), field, value. Returns 1, or 0 when another run owns the task.
RUN_HSET_LUA = """
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'run') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return 1
"""

# A router's heartbeat for the entries it runs: each still its own (XPENDING names the consumer)
# is claimed again (its idle time reset) and its task's keys live on for the unfinished TTL; each
# another router took over is returned, for its run here to stop. A blind XCLAIM took entries
# back from the router that had taken them over.
# KEYS: the work queue, then per entry its task's hash, text, token ids, events.
# ARGV: group, consumer, unfinished ttl seconds, then the entry ids. Returns the lost entry ids.
HEARTBEAT_LUA = """
local lost = {}
for i = 4, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if pending[1] and pending[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    local first = 2 + (i - 4) * 4
    for j = first, first + 3 do redis.call('EXPIRE', KEYS[j], ARGV[3]) end
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""

# A run a stopping router hands back: the task is QUEUED again under a fresh queue entry, its
# attempt not counted (a rolling restart is no failure), so another router starts it at once
# instead of after the visibility timeout, continuing after the tokens already delivered.
# Watchers get the QUEUED state as an event, as from any other change of state.
# KEYS: hash, the work queue, events. ARGV: run, group, entry id, task id, running state, queued
# state, now_ms, event payload, events maxlen. Returns 1, or 0 when the run no longer owns a
# running task (nothing changed).
HAND_BACK_LUA = """
if redis.call('HGET', KEYS[1], 'run') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'state') ~= ARGV[5] then
  return 0
end
redis.call('HSET', KEYS[1], 'state', ARGV[6], 'updated_ms', ARGV[7])
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
redis.call('HDEL', KEYS[1], 'run')
redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
redis.call('XADD', KEYS[2], '*', 'task_id', ARGV[4])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[9], '*', 'k', 'task', 'p', ARGV[8])
return 1
"""
