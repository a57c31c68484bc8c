-- Remove an endpoint on a clean shutdown. Fenced: only the holder of the current epoch may.
-- KEYS[1] state hash    weir:{pool}:state
-- KEYS[2] lease zset    weir:{pool}:leases
-- KEYS[3] counters      weir:{pool}:counters
-- KEYS[4] change stream weir:{pool}:changes
-- ARGV[1] endpoint id
-- ARGV[2] epoch the caller holds
-- ARGV[3] change stream maxlen
-- returns 1 if removed, 0 if absent, -1 if the epoch is not the current one (nothing removed).
local m = redis.call('HGET', KEYS[1], ARGV[1])
if not m then
  return 0
end
local se, sv = string.match(m, '^(%d+) (%d+) ')
if se ~= ARGV[2] then
  return -1
end
remove_endpoint(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[3], ARGV[1], se, sv)
return 1
