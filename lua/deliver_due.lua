--[[ deliver_due: append a partition's due delayed messages, exactly once, in due order.

KEYS[1]  partition stream                                  <ns>:{<topic>:<p>}:log
KEYS[2]  the partition's schedule, a zset (id -> due ms)   <ns>:{<topic>:<p>}:schedule
KEYS[3]  the scheduled messages, a hash (id -> message)    <ns>:{<topic>:<p>}:scheduled
KEYS[4]  the partition's scheduler lease                   <ns>:{<topic>:<p>}:schedlease
ARGV[1]  the caller's scheduler lease value
ARGV[2]  at most this many messages per call
ARGV[3]  maxlen retention (0: none)
ARGV[4]  retention_ms (0: none)

A due message is appended and removed from the schedule in one script: exactly once, whoever
runs it and however often. Messages of equal due time go in schedule-id order (send order).

Returns {delivered, next due ms or -1 (nothing scheduled)}.
Error replies
  LEASE_LOST   another client runs this partition's scheduler
  TOPIC_NOT_FOUND   the partition stream does not exist
]]
-- #include includes/append.lua

if redis.call('GET', KEYS[4]) ~= ARGV[1] then
  return redis.error_reply('LEASE_LOST the scheduler lease is held by another client')
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end
local now_ms = server_now_ms()
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[2]))
local delivered = 0
local last = nil
for _, id in ipairs(due) do
  local message = redis.call('HGET', KEYS[3], id)
  if message then
    local first = string.find(message, '\n', 1, true)
    local producer_id = string.sub(message, 1, first - 1)
    local newline = string.find(message, '\n', first + 1, true)
    local layout = string.sub(message, first + 1, newline - 1)
    local args = {}
    local pos = newline + 1
    for _ = 1, #layout do
      local header_end = string.find(message, '\r\n', pos, true)
      local length = tonumber(string.sub(message, pos + 1, header_end - 1))
      local start = header_end + 2
      args[#args + 1] = string.sub(message, start, start + length - 1)
      pos = start + length + 2
    end
    local fields = {}
    for j = 1, #layout do
      local letter = string.sub(layout, j, j)
      if letter == 'v' or args[j] ~= '' then
        fields[#fields + 1] = letter
        fields[#fields + 1] = args[j]
      end
    end
    if producer_id ~= '' then
      fields[#fields + 1] = 'p'
      fields[#fields + 1] = producer_id
    end
    last = redis.call('XADD', KEYS[1], '*', unpack(fields))
    delivered = delivered + 1
  end
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
end
if last then
  trim_retention(KEYS[1], last, tonumber(ARGV[3]), tonumber(ARGV[4]))
end
local next_due = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if next_due[2] then
  return {delivered, tonumber(next_due[2])}
end
return {delivered, -1}
