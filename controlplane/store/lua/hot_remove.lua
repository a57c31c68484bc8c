-- Remove a hot-prefix override before it expires.
-- KEYS[1] hot hash      weir:{pool}:hot
-- KEYS[2] hot expiry    weir:{pool}:hotexp
-- KEYS[3] counters      weir:{pool}:counters
-- KEYS[4] change stream weir:{pool}:changes
-- ARGV[1] prefix key (decimal)
-- ARGV[2] change stream maxlen
-- returns the new table version, or 0 if there was no such override.
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then
  return 0
end
redis.call('ZREM', KEYS[2], ARGV[1])
local hv = redis.call('HINCRBY', KEYS[3], 'hv', 1)
publish(KEYS[3], KEYS[4], ARGV[2], 'x', ARGV[1], '-', fmt(hv) .. ' 0', '')
return hv
