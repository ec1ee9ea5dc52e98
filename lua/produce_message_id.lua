--[[ produce_message_id: append one batch, skipping messages whose id was seen in the dedup window.

KEYS[1]  partition stream                                    <ns>:{<topic>:<p>}:log
KEYS[2]  dedup bucket 0 of the partition, a hash             <ns>:{<topic>:<p>}:dedup:0
KEYS[3]  dedup bucket 1 of the partition, a hash             <ns>:{<topic>:<p>}:dedup:1
KEYS[4]  producer state of (partition, PID), a hash         <ns>:{<topic>:<p>}:pid:<pid>
KEYS[5]  with a "b:" layout only: the partition's counters (DESIGN §14.6), a hash
         <ns>:{<topic>:<p>}:count
ARGV[1]  producer id (PID), stored with each entry
ARGV[2]  epoch of the producer instance
ARGV[3]  dedup window in ms
ARGV[4]  maxlen retention (0: none)
ARGV[5]  retention_ms (0: none)
ARGV[6]  layout letters of the per-message arguments; must contain m (see includes/append.lua);
         prefixed "b:" on a topic of batch entries, where the arguments are the batch's blob
         (model/batches.py) then its n message ids: the new messages are written as one batch
         entry at consecutive offsets, the blob as it came when none is a duplicate
ARGV[7]  number of messages
ARGV[8]  batch number of this producer instance on this partition (0, 1, 2, ...)
ARGV[9]  acked_next: the batch number after the producer's last acknowledged batch here (the
         next expected one when the broker holds no state for this PID, or less than that)
ARGV[10] state_ttl_ms: expiry of the state key, refreshed on every write
ARGV[11] "1" for a named producer, "0" for an anonymous one (see produce_sequence.lua)
ARGV[12...] the messages, #layout arguments each (with "b:", the blob and the ids)

The ids live in the partition's dedup ring (includes/dedup.lua): remembered for at least one
window and at most two, whatever the clocks of the producers that send it. Retention by age is
exact here and runs before the append (includes/append.lua, trim_expired): with a window no
shorter than retention_ms, no message outlives its id, however long the partition stayed quiet.

Batch numbers keep a producer's batches in order when several are in flight: a batch after a
missing one is refused (OUT_OF_ORDER) and re-sent after it. A batch that was written before
goes through the id check again, which answers every message as a duplicate with its offset.
Epochs fence as in produce_sequence.lua.

Bucket hashes map message id -> the stream ID it was first written at. Ids live in two hashes
per partition that are emptied whole, which costs far less memory per id than one key per id.

Returns {flags, first_id, dup_id_1, ..., dup_id_k}: flags has one character per message, "0"
appended or "1" duplicate. The appended messages got consecutive IDs from first_id (empty if none
was appended); dup_id_j is the ID the j-th duplicate was first written at.
Error replies
  TOPIC_NOT_FOUND                       the partition stream does not exist
  PRODUCER_FENCED stored=<e> got=<e>    a newer epoch of this PID is stored here
  UNKNOWN_PRODUCER stored=<e> got=<e>   named producer without its epoch here: nothing written
  OUT_OF_ORDER expected=<n>             a batch before this one is missing: nothing written
  INVALID_CONFIG <name>=<value> ...     a window, TTL or retention argument out of range: nothing
                                        written
  TRYAGAIN ...                          the partition's slot is migrating and its dedup bucket
                                        for this time slice cannot be written: nothing written
]]
-- #include includes/append.lua
-- #include includes/dedup.lua
-- #include includes/state.lua

if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end

local invalid = bad_setting('dedup_window_ms', ARGV[3], 1) or
  bad_setting('retention_messages', ARGV[4], 0) or bad_setting('retention_ms', ARGV[5], 0) or
  bad_setting('state_ttl_ms', ARGV[10], 1)
if invalid then
  return redis.error_reply(invalid)
end

local epoch = tonumber(ARGV[2])
local batch_no = tonumber(ARGV[8])
local acked_next = tonumber(ARGV[9])
local state = redis.call('HMGET', KEYS[4], 'epoch', 'batch')
local stored_epoch = tonumber(state[1])
local last_batch
if stored_epoch and epoch < stored_epoch then
  return redis.error_reply('PRODUCER_FENCED stored=' .. state[1] .. ' got=' .. ARGV[2])
end
if stored_epoch == epoch then
  last_batch = tonumber(state[2]) or -1
elseif ARGV[11] == '1' then
  return redis.error_reply('UNKNOWN_PRODUCER stored=' .. tostring(state[1]) .. ' got=' .. ARGV[2])
else
  last_batch = acked_next - 1
  rewrite_state(KEYS[4], {'epoch', ARGV[2], 'batch', string.format('%.0f', last_batch)})
  redis.call('PEXPIRE', KEYS[4], ARGV[10])
end
-- As in produce_sequence: never expect less than the producer knows was acknowledged (a failover
-- to a replica that missed the last writes would otherwise refuse every later batch).
local expected = math.max(last_batch + 1, acked_next)
if batch_no > expected then
  return redis.error_reply('OUT_OF_ORDER expected=' .. string.format('%.0f', expected))
end

local ring = dedup_ring(KEYS[2], KEYS[3], tonumber(ARGV[3]))
if ring == nil then
  return redis.error_reply('TRYAGAIN the dedup bucket cannot be written while its slot migrates')
end
local current = ring.current
-- Retention by age goes first and exactly: an id is forgotten only once it is older than its
-- window (at least one window, by the server's clock, the clock of this trim), so with a window of
-- at least retention_ms (the default window is retention_ms) every message whose id may be
-- forgotten is gone before a resend of it could be appended.
trim_expired(KEYS[1], ring.now_ms, tonumber(ARGV[5]))

local producer_id = ARGV[1]
local layout = ARGV[6]
local packed = string.sub(layout, 1, 2) == 'b:'
if packed then
  layout = string.sub(layout, 3)
end
local m_at = string.find(layout, 'm', 1, true) - 1
local count = tonumber(ARGV[7])

-- Every id is looked up at once (HMGET per bucket, in chunks), the new ones are appended and then
-- recorded with one HSET: per message, the XADD is the only call. A message is new if its id is
-- in neither bucket nor earlier in this batch; otherwise the answer is the ID it was first
-- written at.
local stride = #layout
local message_ids = {}
if packed then
  for i = 1, count do
    message_ids[i] = ARGV[12 + i]
  end
else
  for i = 1, count do
    message_ids[i] = ARGV[12 + (i - 1) * stride + m_at]
  end
end
local function lookup(bucket)
  if count <= 1000 then
    return redis.call('HMGET', bucket, unpack(message_ids))
  end
  local found = {}
  for from = 1, count, 1000 do
    local last = math.min(from + 999, count)
    local values = redis.call('HMGET', bucket, unpack(message_ids, from, last))
    for j = from, last do
      found[j] = values[j - from + 1]
    end
  end
  return found
end
local in_current = {}
if not ring.fresh then
  in_current = lookup(current)
end
local in_previous = {}
if ring.previous_valid then
  in_previous = lookup(ring.previous)
end
local first_in_batch = {} -- message id -> index of its first occurrence appended by this batch
local duplicate_of = {}   -- index -> the stream ID it was first written at, or that first index
local duplicates = 0
local function claim(i)
  local n = i + 1
  local earlier = in_current[n] or in_previous[n]
  if not earlier then
    local message_id = message_ids[n]
    earlier = first_in_batch[message_id]
    if earlier == nil then
      first_in_batch[message_id] = n
      return true
    end
  end
  duplicate_of[n] = earlier
  duplicates = duplicates + 1
  return false
end

local appended
local maxlen = tonumber(ARGV[4])
if packed then
  local keep = {}
  for i = 0, count - 1 do
    keep[i] = claim(i)
  end
  local blob, n = ARGV[12], count
  if duplicates > 0 then
    blob, n = repack_batch(blob, function(i) return keep[i] end)
  end
  appended = {count = 0, ids = {}}
  if n > 0 then
    local entry = append_batch(KEYS[1], blob, tostring(n), producer_id, nil, KEYS[5])
    if not entry then
      return redis.error_reply('STREAM_ID_EXHAUSTED the batch would pass the last stream ID')
    end
    local ms, seq = string.match(entry.first, '^(%d+)-(%d+)$')
    local next_seq = tonumber(seq)
    for i = 0, count - 1 do
      if keep[i] then
        appended.ids[i + 1] = ms .. '-' .. string.format('%.0f', next_seq)
        next_seq = next_seq + 1
      end
    end
    appended.count, appended.first, appended.last = n, entry.first, entry.last
    maxlen = batch_maxlen(KEYS[1], maxlen, KEYS[5], n)
  end
else
  appended = append_messages(KEYS[1], layout, 12, count, producer_id, nil, claim)
end
-- Remember every appended id with the ID XADD gave it (HSET of 500 fields a call).
local ids = appended.ids
local remembered = {}
local remembered_n = 0
for i = 1, count do
  if ids[i] then
    remembered[remembered_n + 1] = message_ids[i]
    remembered[remembered_n + 2] = ids[i]
    remembered_n = remembered_n + 2
  end
end
for from = 1, remembered_n, 1000 do
  redis.call('HSET', current, unpack(remembered, from, math.min(from + 999, remembered_n)))
end
local result = {'', appended.first or ''}
if duplicates == 0 then
  result[1] = string.rep('0', count)
else
  local flags = {}
  for i = 1, count do
    if ids[i] then
      flags[i] = '0'
    else
      flags[i] = '1'
      local earlier = duplicate_of[i]
      if type(earlier) == 'number' then
        earlier = ids[earlier]
      end
      result[#result + 1] = earlier
    end
  end
  result[1] = table.concat(flags)
end
if batch_no == expected then
  redis.call('HSET', KEYS[4], 'batch', ARGV[8])
  redis.call('PEXPIRE', KEYS[4], ARGV[10])
end
if appended.count > 0 then
  dedup_seal(ring)
  trim_retention(KEYS[1], appended.last, maxlen, 0)
end
return result
