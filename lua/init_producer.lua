--[[ init_producer: give a named producer its PID and a new epoch (fencing older instances).

KEYS[1]  the named producer's hash {pid, epoch}    <ns>:{<ns>}:producer:<name>
KEYS[2]  the namespace's PID counter               <ns>:{<ns>}:pid-counter
KEYS[3]  the set of topics this name has written   <ns>:{<ns>}:producer:<name>:topics
ARGV[1]  registry_ttl_ms: expiry of both hashes, refreshed at every start and topic registration

The caller then fences every partition of every topic in the returned set (fence_producer.lua),
so an older instance is refused on every partition it may still write to.

Returns {pid, epoch, topic_1, ..., topic_n}.
Error replies: none of its own.
]]
-- #include includes/producer_id.lua

local pid = registered_producer_id(KEYS[1], KEYS[2])
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[3], ARGV[1])
local result = {pid, epoch}
for _, topic in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  result[#result + 1] = topic
end
return result
