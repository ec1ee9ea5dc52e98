--[[ produce: append one batch without idempotence (at-least-once; a retry may duplicate).

KEYS[1]  partition stream              <ns>:{<topic>:<p>}:log
KEYS[2]  with ARGV[4] "b" only: the partition's counters (DESIGN §14.6), a hash
         <ns>:{<topic>:<p>}:count
ARGV[1]  producer id (PID), stored with each entry (empty: none)
ARGV[2]  maxlen retention (0: none)
ARGV[3]  retention_ms (0: none)
ARGV[4]  layout letters of the per-message arguments (see includes/append.lua), or "b": the
         batch is ARGV[6], a blob, written as one batch entry (append_batch)
ARGV[5]  number of messages
ARGV[6...] the messages, #layout arguments each

Returns {"OK", first_id}: message i of the batch has ID <ms>-<seq + i> of first_id.
Error replies
  TOPIC_NOT_FOUND   the partition stream does not exist
  INVALID_CONFIG <name>=<value> ...   a retention argument out of range: nothing written
]]
-- #include includes/append.lua

if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end

local invalid = bad_setting('retention_messages', ARGV[2], 0) or
  bad_setting('retention_ms', ARGV[3], 0)
if invalid then
  return redis.error_reply(invalid)
end

local producer_id = ARGV[1]
if producer_id == '' then
  producer_id = nil
end
local appended
local maxlen = tonumber(ARGV[2])
if ARGV[4] == 'b' then
  appended = append_batch(KEYS[1], ARGV[6], ARGV[5], producer_id, nil, KEYS[2])
  if not appended then
    return redis.error_reply('STREAM_ID_EXHAUSTED the batch would pass the last stream ID')
  end
  maxlen = batch_maxlen(KEYS[1], maxlen, KEYS[2], appended.count)
else
  appended = append_messages(KEYS[1], ARGV[4], 6, tonumber(ARGV[5]), producer_id, nil, nil)
end
trim_retention(KEYS[1], appended.last, maxlen, tonumber(ARGV[3]))
return {'OK', appended.first}
