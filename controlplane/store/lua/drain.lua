-- Mark an endpoint draining: out of routing, lease and state kept until it deregisters.
-- Draining is sticky: later heartbeats cannot make the endpoint ready again.
-- KEYS[1] state hash    weir:{pool}:state
-- KEYS[2] lease zset    weir:{pool}:leases
-- KEYS[3] counters      weir:{pool}:counters
-- KEYS[4] change stream weir:{pool}:changes
-- ARGV[1] endpoint id
-- ARGV[2] epoch the caller holds, or 0 for the operator (drains whatever epoch is current)
-- ARGV[3] change stream maxlen
-- returns 1 if marked (or already draining), 0 if not registered, -1 if the epoch is stale.
local m = redis.call('HGET', KEYS[1], ARGV[1])
if not m then
  return 0
end
local se, sv, lc, lease = string.match(m, '^(%d+) (%d+) (%a+) (%d+)$')
if ARGV[2] ~= '0' and ARGV[2] ~= se then
  return -1
end
if lc == 'draining' then
  return 1
end
local meta = se .. ' ' .. sv .. ' draining ' .. lease
redis.call('HSET', KEYS[1], ARGV[1], meta)
local blob = redis.call('HGET', KEYS[1], ARGV[1] .. '#') or ''
local mv = redis.call('HINCRBY', KEYS[3], 'mv', 1)
publish(KEYS[3], KEYS[4], ARGV[3], 'u', ARGV[1], mv, meta, blob)
return 1
