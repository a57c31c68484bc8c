-- If a holder's lease lapsed (server time), return every charge it held: no ghost
-- reservations survive a crashed router or sidecar. Rate tokens stay spent.
-- KEYS[1] quotas  KEYS[2] usage  KEYS[3] classes  KEYS[4] charges
-- KEYS[5] holder leases  KEYS[6] holder's set  weir:{pool}:held:<holder>
-- ARGV[1] holder
-- returns the number of charges returned, or -1 if the holder's lease is still valid.
local now = server_ms()
local lease = redis.call('ZSCORE', KEYS[5], ARGV[1])
if lease and tonumber(lease) > now then
  return -1
end
local n = 0
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[6])) do
  local field = ARGV[1] .. ' ' .. rid
  local record = redis.call('HGET', KEYS[4], field)
  if record then
    settle(KEYS[1], KEYS[2], KEYS[3], record, nil, now)
    redis.call('HDEL', KEYS[4], field)
    n = n + 1
  end
end
redis.call('DEL', KEYS[6])
redis.call('ZREM', KEYS[5], ARGV[1])
return n
