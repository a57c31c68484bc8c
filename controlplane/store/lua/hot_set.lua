-- Set (or replace) a hot-prefix override: extra owners for one prefix key, until expiry.
-- KEYS[1] hot hash      weir:{pool}:hot       prefix key -> 'version expires_ms blob'
-- KEYS[2] hot expiry    weir:{pool}:hotexp    prefix key -> expiry, server ms
-- KEYS[3] counters      weir:{pool}:counters
-- KEYS[4] change stream weir:{pool}:changes
-- ARGV[1] prefix key (decimal)
-- ARGV[2] override blob (HotPrefix, msgpack)
-- ARGV[3] ttl, ms
-- ARGV[4] change stream maxlen
-- returns {table version, expires_ms}
local expires = server_ms() + tonumber(ARGV[3])
local hv = redis.call('HINCRBY', KEYS[3], 'hv', 1)
local meta = fmt(hv) .. ' ' .. fmt(expires)
redis.call('HSET', KEYS[1], ARGV[1], meta .. ' ' .. ARGV[2])
redis.call('ZADD', KEYS[2], expires, ARGV[1])
publish(KEYS[3], KEYS[4], ARGV[4], 'h', ARGV[1], '-', meta, ARGV[2])
return {hv, expires}
