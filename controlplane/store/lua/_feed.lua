-- Prelude prepended to every script of the store (see scripts.py).
--
-- The pool's counters live in one hash, weir:{pool}:counters:
--   seq    number of the last change published to the feed
--   inc    the feed's incarnation: set when seq starts at 1 (a new or wiped Redis), so a
--          reader holding a position from another incarnation knows to resynchronise
--   mv     membership version: bumped whenever the set of routable endpoints may change
--   epoch  the last epoch handed out (fencing tokens)
--   hv     hot-prefix table version
--
-- publish(): append one change to the pool's change stream, whose entry ids are `0-<seq>`
-- so a reader asks for "everything after seq N" and sees a gap as a missing number.
--   counters  weir:{pool}:counters
--   changes   weir:{pool}:changes
--   maxlen    approximate number of entries kept (older ones are trimmed: readers resync)
--   kind      'u' endpoint upserted, 'g' endpoint gone, 'h' hot prefix set, 'x' hot prefix removed
--   id        endpoint id or hot prefix key
--   meta      'epoch version lifecycle lease_ms' for endpoints, 'version expires_ms' for hot prefixes
--   mv        membership version after the change
--   blob      the record (msgpack), '' for removals
-- returns the change's sequence number.
local function publish(counters, changes, maxlen, kind, id, meta, mv, blob)
  local q = redis.call('HINCRBY', counters, 'seq', 1)
  if q == 1 then
    local t = redis.call('TIME')
    redis.call('HSET', counters, 'inc', t[1] .. string.format('%06d', tonumber(t[2])))
  end
  redis.call('XADD', changes, 'MAXLEN', '~', maxlen, '0-' .. q,
    'k', kind, 'id', id, 'm', meta, 'mv', mv, 's', blob)
  return q
end

-- Redis server time in milliseconds: the only clock leases and expiries are measured by.
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function fmt(n)
  return string.format('%d', n)
end

-- Remove an endpoint's records and publish its departure; returns the membership version.
local function remove_endpoint(meta, state, leases, counters, changes, maxlen, ep, epoch, version)
  redis.call('HDEL', meta, ep)
  redis.call('HDEL', state, ep)
  redis.call('ZREM', leases, ep)
  local mv = redis.call('HINCRBY', counters, 'mv', 1)
  publish(counters, changes, maxlen, 'g', ep, epoch .. ' ' .. version .. ' gone 0', mv, '')
  return mv
end
