-- Issue a prefill->decode handoff credit: promise KV bytes on a decode class until expiry.
-- KEYS[1] credits  KEYS[2] credit expiry  KEYS[3] credit budget   (see _credit.lua)
-- ARGV[1] credit id  ARGV[2] decode class  ARGV[3] KV bytes  ARGV[4] ttl, ms
-- ARGV[5] most expired credits swept first
-- returns {1, expires_ms, class, bytes} when issued, or already issued under this id
--   (idempotent: the credit held, whatever class and bytes the retry names),
--   {0, 'unknown_class'} when the class has no budget, {0, 'too_large_for_any_endpoint',
--   retry_after_ms} when the bytes exceed the class's largest endpoint's room ('max:'),
--   {0, 'insufficient', retry_after_ms} when the class's budget is promised
--   (retry_after_ms, for both: until the next credit expires; -1 when none is out).
local now = server_ms()
expire_credits(KEYS[1], KEYS[2], KEYS[3], now, tonumber(ARGV[5]))
local existing = redis.call('HGET', KEYS[1], ARGV[1])
if existing then
  local class, bytes, expires = string.match(existing, '^(%S+) (%d+) (%d+)$')
  return {1, tonumber(expires), class, tonumber(bytes)}
end
local cap = redis.call('HGET', KEYS[3], 'cap:' .. ARGV[2])
if not cap then
  return {0, 'unknown_class'}
end
local out = tonumber(redis.call('HGET', KEYS[3], 'out:' .. ARGV[2]) or 0)
local bytes = tonumber(ARGV[3])
local largest = redis.call('HGET', KEYS[3], 'max:' .. ARGV[2])
local refused = nil
if largest and bytes > tonumber(largest) then
  refused = 'too_large_for_any_endpoint'
elseif out + bytes > tonumber(cap) then
  refused = 'insufficient'
end
if refused then
  local next = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  local wait = -1
  if next[2] then
    wait = math.max(0, tonumber(next[2]) - now)
  end
  return {0, refused, wait}
end
local expires = now + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. fmt(expires))
redis.call('ZADD', KEYS[2], expires, ARGV[1])
redis.call('HINCRBY', KEYS[3], 'out:' .. ARGV[2], bytes)
return {1, expires, ARGV[2], bytes}
