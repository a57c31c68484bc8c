-- Mark an endpoint draining: out of routing, lease and state kept until it deregisters.
-- Draining is sticky: later heartbeats cannot make the endpoint ready again.
-- KEYS[1] meta hash     weir:{pool}:meta
-- KEYS[2] state hash    weir:{pool}:state
-- KEYS[3] lease zset    weir:{pool}:leases
-- KEYS[4] counters      weir:{pool}:counters
-- KEYS[5] change stream weir:{pool}:changes
-- ARGV[1] endpoint id
-- ARGV[2] epoch the caller holds, or 0 for the operator (drains whatever epoch is current)
-- ARGV[3] change stream maxlen
-- returns 1 if marked (or already draining), 0 if not registered, -1 if the epoch is stale.
local m = redis.call('HGET', KEYS[1], ARGV[1])
if not m then
  return 0
end
local se, sv, lc = string.match(m, '^(%d+) (%d+) (%a+)$')
if ARGV[2] ~= '0' and ARGV[2] ~= se then
  return -1
end
if lc == 'draining' then
  return 1
end
local meta = se .. ' ' .. sv .. ' draining'
redis.call('HSET', KEYS[1], ARGV[1], meta)
local lease = redis.call('ZSCORE', KEYS[3], ARGV[1]) or '0'
local mv = redis.call('HINCRBY', KEYS[4], 'mv', 1)
publish(KEYS[4], KEYS[5], ARGV[3], 'u', ARGV[1], meta .. ' ' .. fmt(tonumber(lease)), mv,
  redis.call('HGET', KEYS[2], ARGV[1]) or '')
return 1
