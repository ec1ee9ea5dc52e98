--[[ tx_apply: roll one staged batch of a committed transaction forward into its partition, once.

KEYS[1]  partition stream                                    <ns>:{<topic>:<p>}:log
KEYS[2]  dedup bucket 0 of the partition, a hash             <ns>:{<topic>:<p>}:dedup:0
KEYS[3]  dedup bucket 1 of the partition, a hash             <ns>:{<topic>:<p>}:dedup:1
ARGV[1]  the batch's mark: transaction id, ":", the batch's index in the transaction
ARGV[2]  dedup window in ms (the topic's)
ARGV[3]  maxlen retention (0: none)
ARGV[4]  retention_ms (0: none)
ARGV[5]  producer id stored with each entry ("" for none)
ARGV[6]  layout letters of the per-message arguments (see includes/append.lua)
ARGV[7]  number of messages
ARGV[8...] the messages, #layout arguments each

The batch is appended whole and its mark remembered in the partition's dedup ring (under a
field no message id can take: it starts with a NUL byte), in one script: a roll-forward repeated
after a crash, by the producer, its next instance, a consumer or the sweeper, writes nothing
twice within the topic's dedup window (24 h by default; recovery runs within seconds).

Returns
  {"OK", first_id}    appended; message i of the batch has ID <ms>-<seq + i> of first_id
  {"DUP", first_id}   rolled forward before: nothing written
Error replies
  TOPIC_NOT_FOUND   the partition stream does not exist (the topic was deleted)
]]
-- #include includes/append.lua
-- #include includes/dedup.lua

if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end
local mark = '\0tx:' .. ARGV[1]
local ring = dedup_ring(KEYS[2], KEYS[3], tonumber(ARGV[2]))
local earlier = nil
if not ring.fresh then
  earlier = redis.call('HGET', ring.current, mark)
end
if not earlier and ring.previous_valid then
  earlier = redis.call('HGET', ring.previous, mark)
end
if earlier then
  return {'DUP', earlier}
end
local producer_id = ARGV[5]
if producer_id == '' then
  producer_id = nil
end
local appended = append_messages(KEYS[1], ARGV[6], 8, tonumber(ARGV[7]), producer_id, nil, nil)
redis.call('HSET', ring.current, mark, appended.first)
dedup_seal(ring)
trim_retention(KEYS[1], appended.last, tonumber(ARGV[3]), tonumber(ARGV[4]))
return {'OK', appended.first}
