--[[ produce_message_id: append one batch, skipping messages whose id was seen in the dedup window.

KEYS[1]  partition stream                                    <ns>:{<topic>:<p>}:log
KEYS[2]  dedup bucket of the current time slice, a hash      <ns>:{<topic>:<p>}:dedup:<b>
KEYS[3]  dedup bucket of the previous time slice, a hash     <ns>:{<topic>:<p>}:dedup:<b-1>
ARGV[1]  producer id (PID), stored with each entry (empty: none)
ARGV[2]  expiry of the current bucket in ms (the end of the next slice: an id is remembered for
         at least one window and at most two)
ARGV[3]  maxlen retention (0: none)
ARGV[4]  retention_ms (0: none)
ARGV[5]  layout letters of the per-message arguments; must contain m (see includes/append.lua)
ARGV[6]  number of messages
ARGV[7...] the messages, #layout arguments each

Bucket hashes map message id -> the stream ID it was first written at. Ids live in per-slice
hashes that expire whole, which costs far less memory per id than one key per id.

Returns {flags, id_1, ..., id_n}: flags has one character per message, "0" appended or "1"
duplicate; id_i is the ID the message was (first) written at.
Error replies
  TOPIC_NOT_FOUND   the partition stream does not exist
]]
-- #include includes/append.lua

if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end

local producer_id = ARGV[1]
if producer_id == '' then
  producer_id = nil
end
local layout = ARGV[5]
local letters = layout_letters_of(layout)
local stride = #layout
local m_at = string.find(layout, 'm', 1, true) - 1
local count = tonumber(ARGV[6])

local appender = new_appender(KEYS[1])
local flags = {}
local result = {''}
for i = 0, count - 1 do
  local pos = 7 + i * stride
  local message_id = ARGV[pos + m_at]
  local seen = redis.call('HGET', KEYS[2], message_id)
  if not seen then
    seen = redis.call('HGET', KEYS[3], message_id)
  end
  if seen then
    flags[i + 1] = '1'
    result[i + 2] = seen
  else
    local id = appender.add(message_fields(letters, stride, pos, producer_id, nil))
    redis.call('HSET', KEYS[2], message_id, id)
    flags[i + 1] = '0'
    result[i + 2] = id
  end
end
if appender.count > 0 then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  trim_retention(KEYS[1], appender.last, tonumber(ARGV[3]), tonumber(ARGV[4]))
end
result[1] = table.concat(flags)
return result
