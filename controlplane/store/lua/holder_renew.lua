-- Start or renew a quota holder's lease (a router replica or a sidecar), by server time.
-- KEYS[1] holder leases weir:{pool}:holders
-- ARGV[1] holder  ARGV[2] ttl, ms
-- returns the lease expiry, server ms.
local lease = server_ms() + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], lease, ARGV[1])
return lease
