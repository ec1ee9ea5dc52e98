--[[ join_group: register a consumer group of a topic (once) and a member's first heartbeat.

KEYS[1]  the topic's set of group names      <ns>:{<ns>}:groups:<topic>
KEYS[2]  the group's settings hash            <ns>:{<ns>}:group:<topic>:<group>
KEYS[3]  the group's members, a zset          <ns>:{<ns>}:group:<topic>:<group>:members
ARGV[1]  group name
ARGV[2]  mode: orderly | concurrent
ARGV[3]  start: earliest | latest (used only when the group is new)
ARGV[4]  member name
ARGV[5]  failure policy (stored for describe; the last member to join wins)

The group's start position is fixed here, once, from server time: "0" for earliest,
"<now_ms>-18446744073709551615" for latest: after every entry of the join's millisecond (an XADD
of that millisecond may have come before the join; the client waits for the server's clock to
leave it before it returns, so what its user sends afterwards comes after). Every member and
partition uses the stored value.

Returns {created (1|0), start_id, now_ms}.
Error replies
  GROUP_MODE stored=<mode> got=<mode>   the group exists with another mode
]]
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local stored = redis.call('HMGET', KEYS[2], 'mode', 'start_id')
local created = 0
local start_id = stored[2]
if not stored[1] then
  start_id = '0'
  if ARGV[3] == 'latest' then
    start_id = string.format('%.0f', now_ms) .. '-18446744073709551615'
  end
  redis.call('HSET', KEYS[2], 'mode', ARGV[2], 'start', ARGV[3], 'start_id', start_id,
    'created_ms', string.format('%.0f', now_ms))
  redis.call('SADD', KEYS[1], ARGV[1])
  created = 1
elseif stored[1] ~= ARGV[2] then
  return redis.error_reply('GROUP_MODE stored=' .. stored[1] .. ' got=' .. ARGV[2])
end
redis.call('HSET', KEYS[2], 'policy', ARGV[5])
redis.call('ZADD', KEYS[3], now_ms, ARGV[4])
return {created, start_id, now_ms}
