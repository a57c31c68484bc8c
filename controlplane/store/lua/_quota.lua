-- Quota helpers, prepended after _feed.lua to the quota scripts (see scripts.py).
--
-- weir:{pool}:quotas   tenant -> 'concurrency in_per_min out_per_min kv_per_min class reserved'
--                      (0 = unlimited), written by QuotaStore.set_quota
-- weir:{pool}:usage    '<tenant>:c' concurrency in use; for each rate d in i, o, k:
--                      '<tenant>:d' tokens left in the bucket, '<tenant>:dt' when it was
--                      last filled (server ms). Buckets hold one minute's allowance and
--                      refill continuously.
-- weir:{pool}:classes  'cap' pool concurrency capacity (0 = none), 'f:<class>' reserved
--                      fraction, 'u:<class>' concurrency in use by the class
-- weir:{pool}:charges  '<holder> <request>' -> 'tenant class conc in out kv'

local RATES = {'i', 'o', 'k'}

-- Bucket level of rate d for tenant t at server time now (limit per minute).
local function bucket(usage, t, d, limit, now)
  local level = tonumber(redis.call('HGET', usage, t .. ':' .. d) or limit)
  local since = tonumber(redis.call('HGET', usage, t .. ':' .. d .. 't') or now)
  return math.min(limit, level + (now - since) * limit / 60000)
end

local function set_bucket(usage, t, d, level, now)
  redis.call('HSET', usage, t .. ':' .. d, tostring(level), t .. ':' .. d .. 't', fmt(now))
end

-- Return a charge's concurrency to its tenant and class; refund unused rate tokens when
-- `used` (a table of three numbers, or nil) says how much was really spent.
local function settle(quotas, usage, classes, record, used, now)
  local t, class, conc, ti, to, tk = string.match(record, '^(%S+) (%S+) (%d+) (%d+) (%d+) (%d+)$')
  conc = tonumber(conc)
  if conc > 0 then
    redis.call('HINCRBY', usage, t .. ':c', -conc)
    redis.call('HINCRBY', classes, 'u:' .. class, -conc)
  end
  local q = redis.call('HGET', quotas, t)
  if used and q then
    local limits = {string.match(q, '^(%d+) (%d+) (%d+) (%d+) ')}
    local charged = {tonumber(ti), tonumber(to), tonumber(tk)}
    for j, d in ipairs(RATES) do
      local limit = tonumber(limits[j + 1])
      local refund = charged[j] - used[j]
      if limit > 0 and refund > 0 then
        set_bucket(usage, t, d, math.min(limit, bucket(usage, t, d, limit, now) + refund), now)
      end
    end
  end
  return t
end
