-- Expire lapsed handoff credits (server time), returning their bytes to the budgets.
-- KEYS[1] credits  KEYS[2] credit expiry  KEYS[3] credit budget   (see _credit.lua)
-- ARGV[1] most credits expired in one call
-- returns the number expired.
return expire_credits(KEYS[1], KEYS[2], KEYS[3], server_ms(), tonumber(ARGV[1]))
