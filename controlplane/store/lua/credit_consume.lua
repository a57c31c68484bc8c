-- Consume a handoff credit: the decode side has taken the KV it promised (once only).
-- KEYS[1] credits  KEYS[2] credit expiry  KEYS[3] credit budget   (see _credit.lua)
-- ARGV[1] credit id
-- returns {1, decode_class, kv_bytes, expires_ms} when consumed, {0, 'expired'} if it
--   lapsed (by server time; its bytes go back), {0, 'unknown'} if absent or already used.
local now = server_ms()
local record = redis.call('HGET', KEYS[1], ARGV[1])
if not record then
  return {0, 'unknown'}
end
local class, bytes, expires = string.match(record, '^(%S+) (%d+) (%d+)$')
drop_credit(KEYS[1], KEYS[2], KEYS[3], ARGV[1], record)
if tonumber(expires) <= now then
  return {0, 'expired'}
end
return {1, class, tonumber(bytes), tonumber(expires)}
