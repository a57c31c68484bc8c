-- Charge a request to a tenant's quota, all dimensions at once or none.
-- KEYS[1] quotas        weir:{pool}:quotas
-- KEYS[2] usage         weir:{pool}:usage
-- KEYS[3] classes       weir:{pool}:classes
-- KEYS[4] charges       weir:{pool}:charges
-- KEYS[5] holder leases weir:{pool}:holders     holder -> lease expiry, server ms
-- KEYS[6] holder's set  weir:{pool}:held:<holder>
-- ARGV[1] tenant  ARGV[2] holder  ARGV[3] request id
-- ARGV[4] concurrency  ARGV[5] input tokens  ARGV[6] output tokens  ARGV[7] KV token-seconds
--         (0 = this dimension is not charged by this caller)
-- returns {granted 1/0, reason, retry_after_ms}; reason is '' or 'duplicate' when granted,
--   else 'unknown_tenant', 'holder_expired', 'concurrency', 'class_capacity',
--   'input_tokens', 'output_tokens', 'kv_token_seconds' (retry_after_ms -1: never fits)
local now = server_ms()
local t, holder, rid = ARGV[1], ARGV[2], ARGV[3]
local field = holder .. ' ' .. rid
if redis.call('HEXISTS', KEYS[4], field) == 1 then
  return {1, 'duplicate', 0}
end
local q = redis.call('HGET', KEYS[1], t)
if not q then
  return {0, 'unknown_tenant', -1}
end
local lease = tonumber(redis.call('ZSCORE', KEYS[5], holder) or 0)
if lease <= now then
  return {0, 'holder_expired', -1}
end
local maxc, li, lo, lk, class = string.match(q, '^(%d+) (%d+) (%d+) (%d+) (%S+) ')
maxc = tonumber(maxc)
local conc = tonumber(ARGV[4])
local amounts = {tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])}
local limits = {tonumber(li), tonumber(lo), tonumber(lk)}
local names = {'input_tokens', 'output_tokens', 'kv_token_seconds'}

if conc > 0 then
  local used = tonumber(redis.call('HGET', KEYS[2], t .. ':c') or 0)
  if maxc > 0 and used + conc > maxc then
    return {0, 'concurrency', 1000}
  end
  local cap = tonumber(redis.call('HGET', KEYS[3], 'cap') or 0)
  if cap > 0 then
    -- Each class first fills its reserved slots, then the shared remainder.
    local all = redis.call('HGETALL', KEYS[3])
    local reserved, inuse = {}, {}
    local reserved_total = 0
    for j = 1, #all, 2 do
      local k, v = all[j], tonumber(all[j + 1])
      local kind, c = string.match(k, '^(%a):(.+)$')
      if kind == 'f' then
        reserved[c] = math.floor(v * cap)
        reserved_total = reserved_total + reserved[c]
      elseif kind == 'u' then
        inuse[c] = v
      end
    end
    local shared_used = 0
    for c, u in pairs(inuse) do
      shared_used = shared_used + math.max(0, u - (reserved[c] or 0))
    end
    local mine = inuse[class] or 0
    local r = reserved[class] or 0
    local extra = math.max(0, mine + conc - r) - math.max(0, mine - r)
    if shared_used + extra > cap - reserved_total then
      return {0, 'class_capacity', 1000}
    end
  end
end

local levels = {}
for j, d in ipairs(RATES) do
  if limits[j] > 0 and amounts[j] > 0 then
    if amounts[j] > limits[j] then
      return {0, names[j], -1}
    end
    levels[j] = bucket(KEYS[2], t, d, limits[j], now)
    if levels[j] < amounts[j] then
      return {0, names[j], math.ceil((amounts[j] - levels[j]) * 60000 / limits[j])}
    end
  end
end

for j, d in ipairs(RATES) do
  if levels[j] then
    set_bucket(KEYS[2], t, d, levels[j] - amounts[j], now)
  end
end
if conc > 0 then
  redis.call('HINCRBY', KEYS[2], t .. ':c', conc)
  redis.call('HINCRBY', KEYS[3], 'u:' .. class, conc)
end
redis.call('HSET', KEYS[4], field, t .. ' ' .. class .. ' ' .. ARGV[4] .. ' ' .. ARGV[5] .. ' ' .. ARGV[6] .. ' ' .. ARGV[7])
redis.call('SADD', KEYS[6], rid)
return {1, '', 0}
