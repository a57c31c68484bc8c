-- Credit helpers, prepended after _feed.lua to the credit scripts (see scripts.py).
--
-- weir:{pool}:credits      credit id -> 'decode_class kv_bytes expires_ms'
-- weir:{pool}:creditexp    credit id -> expiry, server ms
-- weir:{pool}:creditbudget 'cap:<class>' KV bytes a decode class may have promised at once,
--                          'max:<class>' KV bytes one credit may promise (the room of the
--                          class's largest endpoint; absent: no such bound),
--                          'out:<class>' KV bytes promised by outstanding credits

-- Drop one credit and give its bytes back to its class's budget.
local function drop_credit(credits, expiry, budget, id, record)
  local class, bytes = string.match(record, '^(%S+) (%d+) ')
  redis.call('HINCRBY', budget, 'out:' .. class, -tonumber(bytes))
  redis.call('HDEL', credits, id)
  redis.call('ZREM', expiry, id)
end

-- Expire credits whose time passed (server time), at most `limit`; returns how many.
local function expire_credits(credits, expiry, budget, now, limit)
  local ids = redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, limit)
  for _, id in ipairs(ids) do
    local record = redis.call('HGET', credits, id)
    if record then
      drop_credit(credits, expiry, budget, id, record)
    else
      redis.call('ZREM', expiry, id)
    end
  end
  return #ids
end
