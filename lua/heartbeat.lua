--[[ heartbeat: a member's heartbeat into its group's registry; answers the live members.

KEYS[1]  the group's members, a zset (member -> server ms of its last heartbeat)
         <ns>:{<ns>}:group:<topic>:<group>:members
ARGV[1]  member name
ARGV[2]  session_timeout_ms: a member silent for longer is dead and is removed
ARGV[3]  "leave" to remove the member (a clean close), else "beat"

Server time is the only clock: members with skewed clocks still agree on who is alive.

Returns {now_ms, member, member, ...}: the live members (unsorted; the client sorts them).
Error replies: none of its own.
]]
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
if ARGV[3] == 'leave' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], now_ms, ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.0f', now_ms - tonumber(ARGV[2])))
local result = {now_ms}
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  result[#result + 1] = member
end
return result
