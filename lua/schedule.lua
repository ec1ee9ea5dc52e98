--[[ schedule: store delayed messages of one partition until they are due (acknowledged now).

KEYS[1]  partition stream                                  <ns>:{<topic>:<p>}:log
KEYS[2]  the partition's schedule, a zset (id -> due ms)   <ns>:{<topic>:<p>}:schedule
KEYS[3]  the scheduled messages, a hash (id -> message)    <ns>:{<topic>:<p>}:scheduled
ARGV[1]  number of messages
ARGV[2...] per message: its schedule id, its delay in ms from now ("" when deliver_at is
         given), deliver_at in ms since the epoch ("" when a delay is given), the message (the
         sender's producer id, a newline, the layout letters, a newline, then its RESP-encoded
         arguments; deliver_due.lua appends it with that producer id and no sequence)

The schedule id carries the sender's identity and sequence (or its message id), so a re-sent
message is stored once; ids of equal due time sort in send order (zero-padded), which keeps the
order of a key's messages that fall due together. Due times come from the server's clock.

Returns a string with one character per message: "0" scheduled now, "1" already scheduled.
Error replies
  TOPIC_NOT_FOUND   the partition stream does not exist
]]
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local flags = {}
local at = 2
for i = 1, tonumber(ARGV[1]) do
  local id, delay, deliver_at, message = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3]
  at = at + 4
  local due = tonumber(deliver_at ~= '' and deliver_at or (now_ms + tonumber(delay)))
  if redis.call('HSETNX', KEYS[3], id, message) == 1 then
    redis.call('ZADD', KEYS[2], due, id)
    flags[i] = '0'
  else
    flags[i] = '1'
  end
end
return table.concat(flags)
