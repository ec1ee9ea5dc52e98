--[[ acquire_lease: grant a group's lease on one partition (SET NX PX) with a new fencing token.

KEYS[1]  the lease key                          <ns>:{<topic>:<p>}:lease:<group>
KEYS[2]  the fencing token counter              <ns>:{<topic>:<p>}:fence:<group>
KEYS[3]  the partition stream                   <ns>:{<topic>:<p>}:log
ARGV[1]  group name
ARGV[2]  member name
ARGV[3]  lease_ttl_ms
ARGV[4]  the group's start id ("0" or "<created_ms>-0"), used if the Redis consumer group
         does not exist on this stream yet

The lease value is "<token>:<member>:<granted_ms>"; the holder sends it back with every read and
ack, and the scripts compare it whole, so a token from an earlier grant never matches.

Returns {1, lease value} if granted, {0, current value} if another holder has it.
Error replies
  TOPIC_NOT_FOUND   the partition stream does not exist
]]
-- #include includes/group.lua

local current = redis.call('GET', KEYS[1])
if current then
  return {0, current}
end
if redis.call('EXISTS', KEYS[3]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end
ensure_group(KEYS[3], ARGV[1], ARGV[4])
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local token = redis.call('INCR', KEYS[2])
local value = token .. ':' .. ARGV[2] .. ':' .. string.format('%.0f', now_ms)
redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[3])
return {1, value}
