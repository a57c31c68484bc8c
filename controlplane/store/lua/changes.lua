-- Feed entries after a reader's position, with the feed's incarnation and last entry and
-- the server time, at one instant (a script for the reason snapshot.lua gives). Reads only.
-- KEYS[1] counters      weir:{pool}:counters
-- KEYS[2] change stream weir:{pool}:changes
-- ARGV[1] first entry id wanted ('0-<seq>')  ARGV[2] most entries returned
-- returns {incarnation or false, the last entry (XREVRANGE ... COUNT 1),
--          entries from ARGV[1] on (XRANGE), TIME}
return {
  redis.call('HGET', KEYS[1], 'inc'),
  redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1),
  redis.call('XRANGE', KEYS[2], ARGV[1], '+', 'COUNT', ARGV[2]),
  redis.call('TIME'),
}
