-- Reap what expired by Redis server time: endpoint leases and hot-prefix overrides.
-- KEYS[1] state hash    weir:{pool}:state
-- KEYS[2] lease zset    weir:{pool}:leases
-- KEYS[3] counters      weir:{pool}:counters
-- KEYS[4] change stream weir:{pool}:changes
-- KEYS[5] hot hash      weir:{pool}:hot       prefix key -> 'version expires_ms blob'
-- KEYS[6] hot expiry    weir:{pool}:hotexp    prefix key -> expiry, server ms
-- ARGV[1] most entries of each kind reaped in one call (bounds the script's run time)
-- ARGV[2] change stream maxlen
-- returns {server_ms, reaped endpoint ids..., '', expired hot prefix keys...}
local now = server_ms()
local out = {now}
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, ARGV[1])
for _, ep in ipairs(expired) do
  local m = redis.call('HGET', KEYS[1], ep) or '0 0 ready 0'
  local se, sv = string.match(m, '^(%d+) (%d+) ')
  remove_endpoint(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], ep, se, sv)
  out[#out + 1] = ep
end
out[#out + 1] = ''
local hot = redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', now, 'LIMIT', 0, ARGV[1])
for _, key in ipairs(hot) do
  redis.call('HDEL', KEYS[5], key)
  redis.call('ZREM', KEYS[6], key)
  local hv = redis.call('HINCRBY', KEYS[3], 'hv', 1)
  publish(KEYS[3], KEYS[4], ARGV[2], 'x', key, '-', fmt(hv) .. ' 0', '')
  out[#out + 1] = key
end
return out
