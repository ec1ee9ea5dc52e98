--[[ register_producer_topic: a named producer proves its epoch before it writes to a topic.

KEYS[1]  the named producer's registration, a hash {epoch}   <ns>:{<ns>}:producer:<name>
KEYS[2]  the set of topics this name has written               <ns>:{<ns>}:producer:<name>:topics
ARGV[1]  epoch of the calling instance
ARGV[2]  topic ("" registers nothing: a periodic check of the epoch only)
ARGV[3]  registry_ttl_ms

Called before an instance's first write to a topic, and again before it stores its epoch on a
partition that does not carry it (UNKNOWN_PRODUCER from the produce scripts). Either this runs
before a newer instance's init_producer (which then sees the topic and fences its partitions) or
after it (and this call sees the newer epoch): no window lets a zombie write.

A registration that Redis lost (a restart without persistence, a failover) is written again with
the caller's epoch: the caller held the current epoch, and a newer instance started after the
loss would have registered an epoch from the server's clock, which outranks it.

Returns 1.
Error replies
  PRODUCER_FENCED stored=<e> got=<e>   a newer instance has started
]]
local stored = redis.call('HGET', KEYS[1], 'epoch')
if stored and stored ~= ARGV[1] then
  return redis.error_reply('PRODUCER_FENCED stored=' .. stored .. ' got=' .. ARGV[1])
end
if not stored then
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1])
end
if ARGV[2] ~= '' then
  redis.call('SADD', KEYS[2], ARGV[2])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
