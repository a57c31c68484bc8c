-- Register an endpoint: hand out a new epoch (fencing token), start its lease at version 1.
-- A registration for an id that is already present replaces it: the old holder is fenced.
-- KEYS[1] meta hash     weir:{pool}:meta      endpoint -> 'epoch version lifecycle'
-- KEYS[2] state hash    weir:{pool}:state     endpoint -> EndpointState (msgpack)
-- KEYS[3] lease zset    weir:{pool}:leases    endpoint -> lease expiry, server ms
-- KEYS[4] counters      weir:{pool}:counters
-- KEYS[5] change stream weir:{pool}:changes
-- ARGV[1] endpoint id
-- ARGV[2] epoch floor: the new epoch is above it (a sidecar's last epoch survives a Redis
--         restart that reset the counter, so its epochs keep increasing)
-- ARGV[3] lifecycle claimed by the sidecar ('ready' or 'draining')
-- ARGV[4] state blob
-- ARGV[5] lease ttl, ms
-- ARGV[6] change stream maxlen
-- returns {epoch, lease_expires_ms, membership_version, seq}
local epoch = redis.call('HINCRBY', KEYS[4], 'epoch', 1)
local floor = tonumber(ARGV[2])
if epoch <= floor then
  epoch = floor + 1
  redis.call('HSET', KEYS[4], 'epoch', fmt(epoch))
end
local e = fmt(epoch)
local lease = server_ms() + tonumber(ARGV[5])
local mv = redis.call('HINCRBY', KEYS[4], 'mv', 1)
local meta = e .. ' 1 ' .. ARGV[3]
redis.call('HSET', KEYS[1], ARGV[1], meta)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
redis.call('ZADD', KEYS[3], lease, ARGV[1])
local q = publish(KEYS[4], KEYS[5], ARGV[6], 'u', ARGV[1], meta .. ' ' .. fmt(lease), mv, ARGV[4])
return {epoch, lease, mv, q}
