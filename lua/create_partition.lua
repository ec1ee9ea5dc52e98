--[[ create_partition: create one empty partition stream if it does not exist.

KEYS[1]  partition stream   <ns>:{<topic>:<p>}:log
ARGV     none

An empty stream is made by creating and destroying a consumer group with MKSTREAM: the produce
scripts refuse to write to a stream that does not exist (TOPIC_NOT_FOUND), so a deleted topic is
not brought back by a late producer.

Returns 1 if created, 0 if it existed.
Error replies: none of its own.
]]
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('XGROUP', 'CREATE', KEYS[1], 'redisq-init', '$', 'MKSTREAM')
redis.call('XGROUP', 'DESTROY', KEYS[1], 'redisq-init')
return 1
