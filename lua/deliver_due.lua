--[[ deliver_due: append a partition's due delayed messages, exactly once, in due order, as the
holder of the partition's scheduler lease (taken here when it is free, renewed on every call).

KEYS[1]  partition stream                                  <ns>:{<topic>:<p>}:log
KEYS[2]  the partition's schedule, a zset (id -> due ms)   <ns>:{<topic>:<p>}:schedule
KEYS[3]  the scheduled messages, a hash (id -> message)    <ns>:{<topic>:<p>}:scheduled
KEYS[4]  delivered ids still refused, a zset (id -> until ms)  <ns>:{<topic>:<p>}:delivered
KEYS[5]  the partition's scheduler lease                   <ns>:{<topic>:<p>}:schedlease
KEYS[6]  on a topic of batch entries only: the partition's counters (DESIGN §14.6), a hash
         <ns>:{<topic>:<p>}:count: each delivered message is counted there (one message, one
         entry), and retention by count keeps about ARGV[3] messages (includes/append.lua)
ARGV[1]  the caller's lease token (random per scheduler)
ARGV[2]  at most this many messages per call
ARGV[3]  maxlen retention (0: none)
ARGV[4]  retention_ms (0: none)
ARGV[5]  lease ttl in ms: the lease is taken (if free) or renewed for this long; 0 hands it
         back (deletes it if it is the caller's) and delivers nothing

A due message is appended and removed from the schedule in one script: exactly once, whoever
runs it and however often (the lease only keeps schedulers from doing the same work twice).
Messages of equal due time go in schedule-id order (send order). A delivered message whose
sender may still re-send it (the "refuse until" time stored with it, see schedule.lua, is not
past) leaves a tombstone in KEYS[4] so schedule.lua refuses the copy; tombstones past their
time are dropped here, so KEYS[4] holds only ids whose senders may still retry.

Stored message: "<refuse until ms>\n<producer id>\n<layout>\n<RESP-encoded arguments>".

Returns {delivered, next due ms or -1 (nothing scheduled), the server's time in ms}.
Error replies
  LEASE_LOST        another scheduler holds this partition's lease
  TOPIC_NOT_FOUND   the partition stream does not exist
  INVALID_CONFIG <name>=<value> ...   a retention argument out of range: nothing delivered
]]
-- #include includes/append.lua

local holder = redis.call('GET', KEYS[5])
local ttl = tonumber(ARGV[5])
if holder and holder ~= ARGV[1] then
  return redis.error_reply('LEASE_LOST the scheduler lease is held by another client')
end
if ttl == 0 then
  if holder then
    redis.call('DEL', KEYS[5])
  end
  return {0, -1, server_now_ms()}
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end
local invalid = bad_setting('retention_messages', ARGV[3], 0) or
  bad_setting('retention_ms', ARGV[4], 0)
if invalid then
  return redis.error_reply(invalid)
end
redis.call('SET', KEYS[5], ARGV[1], 'PX', ttl)

local now_ms = server_now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now_ms)
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[2]))
local delivered = 0
local last = nil
for _, id in ipairs(due) do
  local message = redis.call('HGET', KEYS[3], id)
  if message then
    local first = string.find(message, '\n', 1, true)
    local refuse_until = tonumber(string.sub(message, 1, first - 1))
    local second = string.find(message, '\n', first + 1, true)
    local producer_id = string.sub(message, first + 1, second - 1)
    local newline = string.find(message, '\n', second + 1, true)
    local layout = string.sub(message, second + 1, newline - 1)
    local fields = {}
    local pos = newline + 1
    for j = 1, #layout do
      local header_end = string.find(message, '\r\n', pos, true)
      local length = tonumber(string.sub(message, pos + 1, header_end - 1))
      local start = header_end + 2
      local arg = string.sub(message, start, start + length - 1)
      local letter = string.sub(layout, j, j)
      if letter == 'v' or arg ~= '' then
        fields[#fields + 1] = letter
        fields[#fields + 1] = arg
      end
      pos = start + length + 2
    end
    if producer_id ~= '' then
      fields[#fields + 1] = 'p'
      fields[#fields + 1] = producer_id
    end
    last = redis.call('XADD', KEYS[1], '*', unpack(fields))
    delivered = delivered + 1
    if refuse_until > now_ms then
      redis.call('ZADD', KEYS[4], refuse_until, id)
    end
  end
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
end
if last then
  local maxlen = tonumber(ARGV[3])
  if KEYS[6] then
    count_appended(KEYS[6], delivered, delivered)
    maxlen = batch_maxlen(KEYS[1], maxlen, KEYS[6], 1)
  end
  trim_retention(KEYS[1], last, maxlen, tonumber(ARGV[4]))
end
local next_due = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if next_due[2] then
  return {delivered, tonumber(next_due[2]), now_ms}
end
return {delivered, -1, now_ms}
