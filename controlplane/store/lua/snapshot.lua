-- The whole pool at one instant, with the feed position it is at and the server time it
-- was read at (one script rather than a MULTI: on a cluster, TIME in a transaction is
-- refused, and alone it may go to any node, not to the one that holds the pool).
-- Reads only.
-- KEYS[1] state hash    weir:{pool}:state
-- KEYS[2] counters      weir:{pool}:counters
-- KEYS[3] change stream weir:{pool}:changes
-- KEYS[4] hot hash      weir:{pool}:hot
-- returns {state as HGETALL, the last feed entry (XREVRANGE ... COUNT 1),
--          {inc, mv, hv} (false where unset), hot as HGETALL, TIME}
return {
  redis.call('HGETALL', KEYS[1]),
  redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1),
  redis.call('HMGET', KEYS[2], 'inc', 'mv', 'hv'),
  redis.call('HGETALL', KEYS[4]),
  redis.call('TIME'),
}
