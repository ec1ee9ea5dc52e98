--[[ fence_producer: raise the epoch stored for (partition, PID), refusing older instances.

KEYS[1]  producer state of (partition, PID), a hash     <ns>:{<topic>:<p>}:pid:<pid>
ARGV[1]  the new epoch
ARGV[2]  state_ttl_ms

Sequences restart at 0 with a new epoch, as in Kafka.

Returns 1 if fenced now, 0 if the stored epoch was already this one.
Error replies
  PRODUCER_FENCED stored=<e> got=<e>   an even newer epoch is stored: the caller is the zombie
]]
local stored = tonumber(redis.call('HGET', KEYS[1], 'epoch'))
local epoch = tonumber(ARGV[1])
if stored and stored > epoch then
  return redis.error_reply('PRODUCER_FENCED stored=' .. stored .. ' got=' .. epoch)
end
if stored == epoch then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'next', 0, 'nb', 0)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
