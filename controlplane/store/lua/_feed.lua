-- Prelude prepended to every script of the store (see scripts.py).
--
-- The pool's counters live in one hash, weir:{pool}:counters:
--   inc    the feed's incarnation: set by the feed's first entry (a new or wiped Redis), so
--          a reader holding a position from another incarnation knows to resynchronise
--   mv     membership version: bumped whenever the set of routable endpoints may change
--   epoch  the last epoch handed out (fencing tokens)
--   hv     hot-prefix table version
--
-- An endpoint has two fields in weir:{pool}:state: '<id>' = 'epoch version lifecycle
-- lease_ms' (the fencing metadata the scripts check) and '<id>#' = its EndpointState as
-- written (msgpack). '#' cannot occur in an id; scripts store and publish the blob as given.
--
-- publish(): append one change to the pool's change stream. Entry ids are `0-<seq>`, the
-- stream numbering its own entries (XADD 0-*), so a reader asks for "everything after
-- seq N" and sees a gap as a missing number.
-- An entry has two fields: 'h' = '<kind> <id> <mv> <meta>' and 's' = the record blob.
--   kind   'u' endpoint upserted, 'g' endpoint gone, 'h' hot prefix set, 'x' hot prefix removed
--   mv     membership version after the change, or '-' when the change left it alone
--   meta   'epoch version lifecycle lease_ms' for endpoints, 'version expires_ms' for hot prefixes
--   blob   the record (msgpack), '' for removals
-- returns the entry id.
local function publish(counters, changes, maxlen, kind, id, mv, meta, blob)
  local entry = redis.call('XADD', changes, 'MAXLEN', '~', maxlen, '0-*',
    'h', kind .. ' ' .. id .. ' ' .. mv .. ' ' .. meta, 's', blob)
  if entry == '0-1' then
    local t = redis.call('TIME')
    redis.call('HSET', counters, 'inc', t[1] .. string.format('%06d', tonumber(t[2])))
  end
  return entry
end

-- Redis server time in milliseconds: the only clock leases and expiries are measured by.
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function fmt(n)
  return string.format('%d', n)
end

-- Remove an endpoint's records and publish its departure.
local function remove_endpoint(state, leases, counters, changes, maxlen, ep, epoch, version)
  redis.call('HDEL', state, ep, ep .. '#')
  redis.call('ZREM', leases, ep)
  local mv = redis.call('HINCRBY', counters, 'mv', 1)
  publish(counters, changes, maxlen, 'g', ep, mv, epoch .. ' ' .. version .. ' gone 0', '')
end
