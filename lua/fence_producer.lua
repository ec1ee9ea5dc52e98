--[[ fence_producer: store an instance's epoch on a partition, refusing older instances there.

KEYS[1]  producer state of (partition, PID), a hash     <ns>:{<topic>:<p>}:pid:<pid>
ARGV[1]  the epoch
ARGV[2]  state_ttl_ms

Used by a named producer at start (every partition of the topics its name wrote to) and before
its first write to a partition that does not carry its epoch; and by an anonymous producer that
gave up on batches (delivery timeout) to fence its own abandoned epoch on their partitions, so
a late copy of one can never land after what it sends next. Sequences restart at 0 with a new
epoch, as in Kafka.

Returns 1 if stored now, 0 if the stored epoch was already this one.
Error replies
  PRODUCER_FENCED stored=<e> got=<e>   an even newer epoch is stored: the caller is the zombie
]]
-- #include includes/state.lua

local stored = redis.call('HGET', KEYS[1], 'epoch')
local epoch = tonumber(ARGV[1])
if stored and tonumber(stored) > epoch then
  return redis.error_reply('PRODUCER_FENCED stored=' .. stored .. ' got=' .. ARGV[1])
end
if stored and tonumber(stored) == epoch then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 0
end
rewrite_state(KEYS[1], {'epoch', ARGV[1], 'next', 0, 'nb', 0, 'batch', -1})
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
