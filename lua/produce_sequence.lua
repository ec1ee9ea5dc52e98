--[[ produce_sequence: append one batch of an idempotent producer (PID + sequence numbers).

KEYS[1]  partition stream                              <ns>:{<topic>:<p>}:log
KEYS[2]  producer state of (partition, PID), a hash     <ns>:{<topic>:<p>}:pid:<pid>
KEYS[3]  with ARGV[10] "b" only: the partition's counters (DESIGN §14.6), a hash
         <ns>:{<topic>:<p>}:count
ARGV[1]  producer id (PID)
ARGV[2]  epoch of the producer instance
ARGV[3]  base sequence of the batch
ARGV[4]  number of messages in the batch
ARGV[5]  acked_next: the sequence after the producer's last acknowledged batch on this partition
         (the next expected sequence when the broker holds no state for this PID and epoch, or
         holds less than was acknowledged, after a failover lost acknowledged writes)
ARGV[6]  window: how many recent batches (with their stream IDs) to remember
ARGV[7]  state_ttl_ms: expiry of the state key, refreshed on every write
ARGV[8]  maxlen retention (0: none)
ARGV[9]  retention_ms (0: none)
ARGV[10] layout letters of the per-message arguments (see includes/append.lua), or "b": ARGV[12]
         is the batch's blob, written as one batch entry with s = the base sequence (no
         per-message sequence numbers follow)
ARGV[11] "1" for a named producer (fenced by its name's registration), "0" for an anonymous one
ARGV[12...] the messages, #layout arguments each, then the sequence number of each message as a
         string (base + i, stored in field s)

State hash fields: epoch, next (next expected sequence), nb (batches written),
w<slot> = "<base>:<count>:<first stream ID>" for the last `window` batches.

A named producer's state on this partition must carry its epoch before it writes here: that
state is what fences older instances, and a missing or older one cannot tell a new instance from
a zombie (the state expired, the partition was added later, Redis lost it). The client then
checks its name's registration (register_producer_topic.lua) and stores its epoch here
(fence_producer.lua) before it sends again. An anonymous producer has no other instance: with
no state for its epoch, its epoch and next = acked_next are stored before the batch is checked,
so an older epoch (its own abandoned batches) is refused from then on.

Returns
  {"OK", first_id}    appended; message i of the batch has ID <ms>-<seq + i> of first_id
  {"DUP", first_id}   the batch was already written inside the window: nothing written
  {"DUP"}             an older duplicate: nothing written, offset unknown
Error replies
  TOPIC_NOT_FOUND                       the partition stream does not exist
  PRODUCER_FENCED stored=<e> got=<e>    a newer epoch of this PID is stored here
  UNKNOWN_PRODUCER stored=<e> got=<e>   named producer without its epoch here: nothing written
  OUT_OF_ORDER expected=<n>             a gap: nothing written, re-send from sequence n
  INVALID_CONFIG <name>=<value> ...     a TTL or retention argument out of range: nothing written
]]
-- #include includes/append.lua
-- #include includes/state.lua

if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end

local invalid = bad_setting('state_ttl_ms', ARGV[7], 1) or
  bad_setting('retention_messages', ARGV[8], 0) or bad_setting('retention_ms', ARGV[9], 0)
if invalid then
  return redis.error_reply(invalid)
end

local epoch = tonumber(ARGV[2])
local base = tonumber(ARGV[3])
local count = tonumber(ARGV[4])
local window = tonumber(ARGV[6])

local state = redis.call('HMGET', KEYS[2], 'epoch', 'next', 'nb')
local stored_epoch = tonumber(state[1])
local next_seq, batches
if stored_epoch and epoch < stored_epoch then
  return redis.error_reply('PRODUCER_FENCED stored=' .. state[1] .. ' got=' .. ARGV[2])
end
if stored_epoch == epoch and state[2] then
  next_seq = tonumber(state[2])
  batches = tonumber(state[3]) or 0
elseif ARGV[11] == '1' then
  return redis.error_reply('UNKNOWN_PRODUCER stored=' .. tostring(state[1]) .. ' got=' .. ARGV[2])
else
  -- No state for this PID and epoch: it expired, or the anonymous producer moved to a new epoch
  -- where no fence reached. Everything before acked_next was acknowledged, so accepting
  -- acked_next opens no gap. The epoch is stored now, even if this batch turns out a duplicate
  -- or a gap: from here on an older epoch is refused.
  next_seq = tonumber(ARGV[5])
  batches = 0
  rewrite_state(KEYS[2], {'epoch', ARGV[2], 'next', string.format('%.0f', next_seq), 'nb', 0})
  redis.call('PEXPIRE', KEYS[2], ARGV[7])
end

-- The broker can be behind what it acknowledged: a failover to a replica that had not received
-- the last writes (acks="leader"), or a restore. The producer knows everything before acked_next
-- was acknowledged and never sends it again, so the sequence moves on to acked_next instead of
-- refusing every later batch as a gap.
local acked_next = tonumber(ARGV[5])
if next_seq < acked_next then
  next_seq = acked_next
end

if base < next_seq then
  local slots = {}
  for slot = 0, window - 1 do
    slots[slot + 1] = 'w' .. slot
  end
  local remembered = redis.call('HMGET', KEYS[2], unpack(slots))
  for _, entry in ipairs(remembered) do
    if entry then
      local wbase, wcount, wfirst = string.match(entry, '^(%d+):(%d+):(.+)$')
      if tonumber(wbase) == base and tonumber(wcount) == count then
        return {'DUP', wfirst}
      end
    end
  end
  return {'DUP'}
end
if base > next_seq then
  return redis.error_reply('OUT_OF_ORDER expected=' .. string.format('%.0f', next_seq))
end

local appended
local maxlen = tonumber(ARGV[8])
if ARGV[10] == 'b' then
  appended = append_batch(KEYS[1], ARGV[12], ARGV[4], ARGV[1], ARGV[3], KEYS[3])
  if not appended then
    return redis.error_reply('STREAM_ID_EXHAUSTED the batch would pass the last stream ID')
  end
  maxlen = batch_maxlen(KEYS[1], maxlen, KEYS[3], count)
else
  appended = append_messages(KEYS[1], ARGV[10], 12, count, ARGV[1], 12 + count * #ARGV[10], nil)
end

redis.call('HSET', KEYS[2],
  'epoch', ARGV[2],
  'next', string.format('%.0f', base + count),
  'nb', batches + 1,
  'w' .. (batches % window), ARGV[3] .. ':' .. ARGV[4] .. ':' .. appended.first)
redis.call('PEXPIRE', KEYS[2], ARGV[7])
trim_retention(KEYS[1], appended.last, maxlen, tonumber(ARGV[9]))
return {'OK', appended.first}
