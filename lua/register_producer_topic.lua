--[[ register_producer_topic: record that a named producer is about to write to a topic.

KEYS[1]  the named producer's hash {pid, epoch}    <ns>:{<ns>}:producer:<name>
KEYS[2]  the set of topics this name has written   <ns>:{<ns>}:producer:<name>:topics
ARGV[1]  epoch of the calling instance
ARGV[2]  topic
ARGV[3]  registry_ttl_ms

Either this runs before a newer instance's init_producer (which then sees the topic and fences
its partitions) or after it (and this call sees the newer epoch): no window lets a zombie write.

Returns 1.
Error replies
  PRODUCER_FENCED stored=<e> got=<e>   a newer instance has started
]]
local stored = redis.call('HGET', KEYS[1], 'epoch')
if stored ~= ARGV[1] then
  return redis.error_reply('PRODUCER_FENCED stored=' .. tostring(stored) .. ' got=' .. ARGV[1])
end
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
