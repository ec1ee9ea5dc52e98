--[[ grow_topic: raise a topic's partition count (never lower it).

KEYS[1]  the topic's metadata hash       <ns>:{<ns>}:topic:<topic>
ARGV[1]  the new partition count

The new partition streams are created before this call (create_partition.lua), so producers that
see the new count can write at once. Growing moves key routing (crc32(key) % partitions).

Returns the previous partition count.
Error replies
  TOPIC_NOT_FOUND            no such topic
  PARTITIONS_NOT_GREATER     the topic already has at least that many partitions
]]
local current = redis.call('HGET', KEYS[1], 'partitions')
if not current then
  return redis.error_reply('TOPIC_NOT_FOUND')
end
if tonumber(ARGV[1]) <= tonumber(current) then
  return redis.error_reply('PARTITIONS_NOT_GREATER current=' .. current)
end
redis.call('HSET', KEYS[1], 'partitions', ARGV[1])
return tonumber(current)
