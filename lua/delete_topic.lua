--[[ delete_topic: remove a topic's metadata (the client then deletes its partition keys).

KEYS[1]  the namespace's topic set       <ns>:{<ns>}:topics
KEYS[2]  the topic's metadata hash       <ns>:{<ns>}:topic:<topic>
ARGV[1]  topic name

Returns the number of partitions the topic had.
Error replies
  TOPIC_NOT_FOUND   no such topic
]]
local partitions = redis.call('HGET', KEYS[2], 'partitions')
if not partitions then
  return redis.error_reply('TOPIC_NOT_FOUND')
end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[1], ARGV[1])
return tonumber(partitions)
