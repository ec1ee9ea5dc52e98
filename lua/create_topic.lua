--[[ create_topic: register a topic's metadata, once.

KEYS[1]  the namespace's topic set       <ns>:{<ns>}:topics
KEYS[2]  the topic's metadata hash       <ns>:{<ns>}:topic:<topic>
ARGV[1]  topic name
ARGV[2...] metadata field/value pairs (partitions, retention_ms, ...)

The partition streams are created before this call (create_partition.lua, one slot each); the
metadata appears last, so a topic that can be described can also be written.

Returns 1.
Error replies
  TOPIC_EXISTS   the metadata hash exists already
]]
if redis.call('EXISTS', KEYS[2]) == 1 then
  return redis.error_reply('TOPIC_EXISTS')
end
local fields = {}
for i = 2, #ARGV do
  fields[i - 1] = ARGV[i]
end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('SADD', KEYS[1], ARGV[1])
return 1
