--[[ schedule: store delayed messages of one partition until they are due (acknowledged now).

KEYS[1]  partition stream                                  <ns>:{<topic>:<p>}:log
KEYS[2]  the partition's schedule, a zset (id -> due ms)   <ns>:{<topic>:<p>}:schedule
KEYS[3]  the scheduled messages, a hash (id -> message)    <ns>:{<topic>:<p>}:scheduled
KEYS[4]  delivered ids still refused, a zset (id -> until ms)  <ns>:{<topic>:<p>}:delivered
KEYS[5]  the sender's producer state on this partition     <ns>:{<topic>:<p>}:pid:<pid>
KEYS[6]  batches given up, a zset (nonce -> until ms)      <ns>:{<topic>:<p>}:abandoned
ARGV[1]  number of messages
ARGV[2]  the sender's retry horizon in ms: it may re-send a message for this long after the
         first attempt (its delivery timeout, plus a margin for a request still on the wire)
ARGV[3]  the sender's epoch ("": not checked, a producer without idempotence): refused when a
         newer epoch of its producer id is stored here (a newer instance of its name fenced it)
ARGV[4]  "1": the sender is a named producer (checked with ARGV[3]): a partition that does not
         carry any epoch of its producer id refuses it (UNKNOWN_PRODUCER) until it proves its
         epoch against its name's registration and stores it here, as the produce scripts do
         (the state expired, the partition was added later, or Redis lost it)
ARGV[5]  this batch's nonce (random, the same in every copy of the batch)
ARGV[6]  n: how many nonces follow, of this sender's batches to this partition that it gave up
         on (their outcome unknown: a copy may still be on the wire); ARGV[7 .. 6 + n] them
ARGV[7 + n ...] per message: its schedule id, its delay in ms from now ("" when deliver_at is
         given), deliver_at in ms since the epoch ("" when a delay is given), the message (the
         sender's producer id, a newline, the layout letters, a newline, then its RESP-encoded
         arguments; deliver_due.lua appends it with that producer id and no sequence)

The schedule id carries the sender's identity and a counter (or the message id), so a re-sent
message is stored once: while it waits here (HSETNX), and after delivery while its sender may
still retry (a tombstone in KEYS[4], left by deliver_due.lua, until the time stored with the
message: now + ARGV[2]). Ids of equal due time sort in send order (zero-padded), which keeps
the order of a key's messages that fall due together. Due times come from the server's clock.

A batch its sender gave up on (delivery timeout, on the wire) must not be scheduled after what
the sender sends next to the partition: the sender's next batch there names it, and is stored
only after the given-up nonce is marked; a copy of the given-up batch that arrives later, for
ABANDONED_KEEP_MS, is refused (ABANDONED) and stores nothing. A copy that arrived before is
scheduled before the newer batch, as any earlier send is.

Returns {flags, due ms of message 1, due ms of message 2, ...}: flags has one character per
message, "0" scheduled now, "1" already scheduled (the due time stored first), "2" already
delivered (due -1).
Error replies
  TOPIC_NOT_FOUND                       the partition stream does not exist
  PRODUCER_FENCED stored=<e> got=<e>    a newer epoch of this producer id is stored here
  UNKNOWN_PRODUCER stored=nil got=<e>   a named sender without its epoch here: nothing stored
  ABANDONED                             a late copy of a batch its sender gave up on: nothing
                                        stored
]]
local ABANDONED_KEEP_MS = 3600 * 1000
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end
if ARGV[3] ~= '' then
  local stored = redis.call('HGET', KEYS[5], 'epoch')
  if stored and tonumber(stored) > tonumber(ARGV[3]) then
    return redis.error_reply('PRODUCER_FENCED stored=' .. stored .. ' got=' .. ARGV[3])
  end
  if not stored and ARGV[4] == '1' then
    return redis.error_reply('UNKNOWN_PRODUCER stored=nil got=' .. ARGV[3])
  end
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
-- The time is written as an integer: tostring() of a large float would use an exponent.
local refuse_until = string.format('%.0f', now_ms + tonumber(ARGV[2])) .. '\n'
local given_up = tonumber(ARGV[6])
if given_up > 0 then  -- marked before anything of this batch is stored
  local keep = now_ms + ABANDONED_KEEP_MS
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now_ms)
  for i = 7, 6 + given_up do
    redis.call('ZADD', KEYS[6], keep, ARGV[i])
  end
  redis.call('PEXPIRE', KEYS[6], ABANDONED_KEEP_MS)
end
local abandoned = redis.call('ZSCORE', KEYS[6], ARGV[5])
if abandoned and tonumber(abandoned) > now_ms then
  return redis.error_reply('ABANDONED the sender gave this batch up: nothing stored')
end
local reply = {''}
local flags = {}
local at = 7 + given_up
for i = 1, tonumber(ARGV[1]) do
  local id, delay, deliver_at, message = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3]
  at = at + 4
  local due = tonumber(deliver_at ~= '' and deliver_at or (now_ms + tonumber(delay)))
  local tombstone = redis.call('ZSCORE', KEYS[4], id)
  if tombstone and tonumber(tombstone) > now_ms then
    flags[i] = '2'
    due = -1
  elseif redis.call('HSETNX', KEYS[3], id, refuse_until .. message) == 1 then
    redis.call('ZADD', KEYS[2], due, id)
    flags[i] = '0'
  else
    flags[i] = '1'
    due = tonumber(redis.call('ZSCORE', KEYS[2], id) or -1)
  end
  reply[i + 1] = due
end
reply[1] = table.concat(flags)
return reply
