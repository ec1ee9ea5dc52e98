--[[ tx_apply: roll one staged batch of a committed transaction forward into its partition, once.

KEYS[1]  partition stream                                    <ns>:{<topic>:<p>}:log
KEYS[2]  dedup bucket 0 of the partition, a hash             <ns>:{<topic>:<p>}:dedup:0
KEYS[3]  dedup bucket 1 of the partition, a hash             <ns>:{<topic>:<p>}:dedup:1
KEYS[4]  the batch's roll-forward mark, a string             <ns>:{<topic>:<p>}:txmark:<mark>
KEYS[5]  with ARGV[5] "b" only: the partition's counters (§14.6) <ns>:{<topic>:<p>}:count
ARGV[1]  the batch's mark: transaction id, ":", the batch's index in the transaction
ARGV[2]  maxlen retention (0: none)
ARGV[3]  retention_ms (0: none)
ARGV[4]  producer id stored with each entry ("" for none)
ARGV[5]  layout letters of the per-message arguments (see includes/append.lua), or "b": the
         batch is ARGV[8], a blob, written as one batch entry (append_batch, a batch topic)
ARGV[6]  number of messages
ARGV[7]  expiry of the mark in ms: only a bound; the transaction's finish shortens it
ARGV[8...] the messages, #layout arguments each (or the blob)

The batch is appended whole and its mark (KEYS[4], holding the first stream ID) written, in one
script: a roll-forward repeated after a crash, by the producer, its next instance, a consumer or
the sweeper, writes nothing twice for as long as the transaction is not carried out, however
long that takes (its staged batches are deleted before the mark's expiry is shortened). Marks
of earlier versions, kept in the dedup buckets under a field no message id can take (it starts
with a NUL byte), are still honoured; they are only read here.

Returns
  {"OK", first_id}    appended; message i of the batch has ID <ms>-<seq + i> of first_id
  {"DUP", first_id}   rolled forward before: nothing written
Error replies
  TOPIC_NOT_FOUND   the partition stream does not exist (the topic was deleted)
]]
-- #include includes/append.lua

if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end
local invalid = bad_setting('retention_messages', ARGV[2], 0) or
  bad_setting('retention_ms', ARGV[3], 0) or bad_setting('mark expiry', ARGV[7], 1)
if invalid then
  return redis.error_reply(invalid)
end
local earlier = redis.call('GET', KEYS[4])
if earlier then
  return {'DUP', earlier}
end
local legacy = '\0tx:' .. ARGV[1]
earlier = redis.call('HGET', KEYS[2], legacy) or redis.call('HGET', KEYS[3], legacy)
if earlier then
  return {'DUP', earlier}
end
local producer_id = ARGV[4]
if producer_id == '' then
  producer_id = nil
end
local appended
local maxlen = tonumber(ARGV[2])
if ARGV[5] == 'b' then
  appended = append_batch(KEYS[1], ARGV[8], ARGV[6], producer_id, nil, KEYS[5])
  if not appended then
    return redis.error_reply('STREAM_ID_EXHAUSTED the batch would pass the last stream ID')
  end
  maxlen = batch_maxlen(KEYS[1], maxlen, KEYS[5], appended.count)
else
  appended = append_messages(KEYS[1], ARGV[5], 8, tonumber(ARGV[6]), producer_id, nil, nil)
end
redis.call('SET', KEYS[4], appended.first, 'PX', ARGV[7])
trim_retention(KEYS[1], appended.last, maxlen, tonumber(ARGV[3]))
return {'OK', appended.first}
