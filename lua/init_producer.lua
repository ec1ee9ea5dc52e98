--[[ init_producer: a new epoch for a named producer, fencing its older instances (KIP-360).

KEYS[1]  the named producer's registration, a hash {epoch}   <ns>:{<ns>}:producer:<name>
KEYS[2]  the set of topics this name has written               <ns>:{<ns>}:producer:<name>:topics
ARGV[1]  registry_ttl_ms: expiry of both keys, refreshed at every start and registration
ARGV[2]  the epoch the caller holds: "" for a new instance (which always gets a new epoch);
         an instance that renews its identity (after a delivery timeout) gets one only while
         the registered epoch is still its own

The new epoch is max(registered + 1, the server's time in ms): it grows even when Redis lost the
registration (a restart without persistence, a failover), so an instance started after the loss
still outranks every instance started before it.

The caller then fences every partition of every topic in the returned set (fence_producer.lua),
so an older instance is refused on every partition it may still write to; a partition it has not
fenced (added later, state expired) refuses the name's writes until the writer proves its epoch
here again (register_producer_topic.lua).

Returns {epoch, topic_1, ..., topic_n}.
Error replies
  PRODUCER_FENCED stored=<e> got=<e>   a renewal by an instance whose epoch was superseded
]]
local stored = redis.call('HGET', KEYS[1], 'epoch')
if ARGV[2] ~= '' and stored and stored ~= ARGV[2] then
  return redis.error_reply('PRODUCER_FENCED stored=' .. stored .. ' got=' .. ARGV[2])
end
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local previous = tonumber(stored or ARGV[2]) or 0
local epoch = math.max(previous + 1, now_ms)
redis.call('HSET', KEYS[1], 'epoch', string.format('%.0f', epoch))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
local result = {string.format('%.0f', epoch)}
for _, topic in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  result[#result + 1] = topic
end
return result
