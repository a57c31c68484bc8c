-- Send a command to one endpoint's stream, at most once per command id.
-- KEYS[1] command stream   weir:{pool}:cmd:<endpoint>
-- KEYS[2] command id guard weir:{pool}:cmdid:<command id>  -> stream entry id
-- ARGV[1] command (msgpack)  ARGV[2] how long the id is remembered, ms
-- ARGV[3] stream maxlen
-- returns {1, entry id} when appended, {0, entry id of the first send} for a repeat.
local first = redis.call('GET', KEYS[2])
if first then
  return {0, first}
end
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', 'c', ARGV[1])
redis.call('SET', KEYS[2], id, 'PX', ARGV[2])
return {1, id}
