-- Register an endpoint: hand out a new epoch (fencing token), start its lease at version 1.
-- A registration for an id that is already present replaces it: the old holder is fenced.
-- KEYS[1] state hash    weir:{pool}:state     endpoint -> meta, endpoint# -> blob
-- KEYS[2] lease zset    weir:{pool}:leases    endpoint -> lease expiry, server ms
-- KEYS[3] counters      weir:{pool}:counters
-- KEYS[4] change stream weir:{pool}:changes
-- ARGV[1] endpoint id
-- ARGV[2] epoch floor: the new epoch is above it (a sidecar's last epoch survives a Redis
--         restart that reset the counter, so its epochs keep increasing)
-- ARGV[3] lifecycle claimed by the sidecar ('ready' or 'draining')
-- ARGV[4] state blob
-- ARGV[5] lease ttl, ms
-- ARGV[6] change stream maxlen
-- returns {epoch, lease_expires_ms, membership_version, feed entry id}
local epoch = redis.call('HINCRBY', KEYS[3], 'epoch', 1)
local floor = tonumber(ARGV[2])
if epoch <= floor then
  epoch = floor + 1
  redis.call('HSET', KEYS[3], 'epoch', fmt(epoch))
end
local lease = server_ms() + tonumber(ARGV[5])
local mv = redis.call('HINCRBY', KEYS[3], 'mv', 1)
local meta = fmt(epoch) .. ' 1 ' .. ARGV[3] .. ' ' .. fmt(lease)
redis.call('HSET', KEYS[1], ARGV[1], meta, ARGV[1] .. '#', ARGV[4])
redis.call('ZADD', KEYS[2], lease, ARGV[1])
local q = publish(KEYS[3], KEYS[4], ARGV[6], 'u', ARGV[1], mv, meta, ARGV[4])
return {epoch, lease, mv, q}
