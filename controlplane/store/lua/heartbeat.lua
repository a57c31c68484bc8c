-- Heartbeat: a fenced, versioned state write that renews the lease by Redis server time.
-- The hot path of the store: five Redis calls; the blob is stored and published as is.
-- KEYS[1] state hash    weir:{pool}:state
-- KEYS[2] lease zset    weir:{pool}:leases
-- KEYS[3] counters      weir:{pool}:counters
-- KEYS[4] change stream weir:{pool}:changes
-- ARGV[1] endpoint id
-- ARGV[2] epoch the sidecar holds
-- ARGV[3] version of this heartbeat (must exceed the stored one)
-- ARGV[4] lifecycle claimed by the sidecar ('ready' or 'draining'; draining is sticky)
-- ARGV[5] state blob
-- ARGV[6] lease ttl, ms
-- ARGV[7] change stream maxlen
-- returns {status, stored epoch, stored version, lifecycle, lease_expires_ms}; status is
--   'ok'       written, lease renewed, change published
--   'stale'    version not above the stored one (a duplicate or reordered beat): no write
--   'fenced'   the stored epoch is newer (the caller is a zombie): no write
--   'unknown'  no record of this epoch (never registered, reaped, Redis lost it): register
--   'expired'  the lease had lapsed by server time: the record is removed now; register
local m = redis.call('HGET', KEYS[1], ARGV[1])
if not m then
  return {'unknown', 0, 0, '', 0}
end
local se, sv, lc, lease = string.match(m, '^(%d+) (%d+) (%a+) (%d+)$')
local e, v = tonumber(ARGV[2]), tonumber(ARGV[3])
if e < tonumber(se) then
  return {'fenced', se, sv, lc, 0}
end
if e > tonumber(se) then
  return {'unknown', se, sv, lc, 0}
end
if v <= tonumber(sv) then
  return {'stale', se, sv, lc, 0}
end
local now = server_ms()
if tonumber(lease) <= now then
  remove_endpoint(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[7], ARGV[1], se, sv)
  return {'expired', se, sv, 'gone', 0}
end
local mv = '-'
local newlc = lc
if ARGV[4] == 'draining' and lc ~= 'draining' then
  newlc = 'draining'
  mv = redis.call('HINCRBY', KEYS[3], 'mv', 1)
end
local expires = now + tonumber(ARGV[6])
local meta = ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. newlc .. ' ' .. fmt(expires)
redis.call('HSET', KEYS[1], ARGV[1], meta, ARGV[1] .. '#', ARGV[5])
redis.call('ZADD', KEYS[2], expires, ARGV[1])
publish(KEYS[3], KEYS[4], ARGV[7], 'u', ARGV[1], mv, meta, ARGV[5])
return {'ok', ARGV[2], ARGV[3], newlc, expires}
