-- Release a charge: concurrency comes back; unused rate tokens are refunded if reported.
-- KEYS[1] quotas  KEYS[2] usage  KEYS[3] classes  KEYS[4] charges
-- KEYS[5] holder's set  weir:{pool}:held:<holder>
-- ARGV[1] holder  ARGV[2] request id
-- ARGV[3] input tokens used  ARGV[4] output tokens used  ARGV[5] KV token-seconds used
--         (-1 for all three: no refund, the charge was spent)
-- returns 1 if released, 0 if there was no such charge (already released or reaped).
local field = ARGV[1] .. ' ' .. ARGV[2]
local record = redis.call('HGET', KEYS[4], field)
if not record then
  return 0
end
local used = nil
if tonumber(ARGV[3]) >= 0 then
  used = {tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])}
end
settle(KEYS[1], KEYS[2], KEYS[3], record, used, server_ms())
redis.call('HDEL', KEYS[4], field)
redis.call('SREM', KEYS[5], ARGV[2])
return 1
