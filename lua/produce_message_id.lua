--[[ produce_message_id: append one batch, skipping messages whose id was seen in the dedup window.

KEYS[1]  partition stream                                    <ns>:{<topic>:<p>}:log
KEYS[2]  dedup bucket of the current time slice, a hash      <ns>:{<topic>:<p>}:dedup:<b>
KEYS[3]  dedup bucket of the previous time slice, a hash     <ns>:{<topic>:<p>}:dedup:<b-1>
KEYS[4]  producer state of (partition, PID), a hash         <ns>:{<topic>:<p>}:pid:<pid>
ARGV[1]  producer id (PID), stored with each entry (empty: none)
ARGV[2]  expiry of the current bucket in ms (the end of the next slice: an id is remembered for
         at least one window and at most two)
ARGV[3]  maxlen retention (0: none)
ARGV[4]  retention_ms (0: none)
ARGV[5]  layout letters of the per-message arguments; must contain m (see includes/append.lua)
ARGV[6]  number of messages
ARGV[7]  batch number of this producer on this partition (0, 1, 2, ...)
ARGV[8]  acked_next: the batch number after the producer's last acknowledged batch here (the
         next expected one when the broker holds no state for this PID, or less than that)
ARGV[9]  state_ttl_ms: expiry of the state key, refreshed on every write
ARGV[10...] the messages, #layout arguments each

Batch numbers keep a producer's batches in order when several are in flight: a batch after a
missing one is refused (OUT_OF_ORDER) and re-sent after it. A batch that was written before
goes through the id check again, which answers every message as a duplicate with its offset.

Bucket hashes map message id -> the stream ID it was first written at. Ids live in per-slice
hashes that expire whole, which costs far less memory per id than one key per id.

Returns {flags, first_id, dup_id_1, ..., dup_id_k}: flags has one character per message, "0"
appended or "1" duplicate. The appended messages got consecutive IDs from first_id (empty if none
was appended); dup_id_j is the ID the j-th duplicate was first written at.
Error replies
  TOPIC_NOT_FOUND             the partition stream does not exist
  OUT_OF_ORDER expected=<n>   a batch before this one is missing: nothing written
]]
-- #include includes/append.lua

if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end

local batch_no = tonumber(ARGV[7])
local last_batch = tonumber(redis.call('HGET', KEYS[4], 'batch'))
-- As in produce_sequence: never expect less than the producer knows was acknowledged (a failover
-- to a replica that missed the last writes would otherwise refuse every later batch).
local expected = math.max(last_batch and last_batch + 1 or 0, tonumber(ARGV[8]))
if batch_no > expected then
  return redis.error_reply('OUT_OF_ORDER expected=' .. string.format('%.0f', expected))
end

local producer_id = ARGV[1]
local layout = ARGV[5]
local m_at = string.find(layout, 'm', 1, true) - 1
local count = tonumber(ARGV[6])

-- Every id is looked up at once (HMGET per bucket, in chunks), the new ones are appended and then
-- recorded with one HSET: per message, the XADD is the only call. A message is new if its id is
-- in neither bucket nor earlier in this batch; otherwise the answer is the ID it was first
-- written at.
local stride = #layout
local message_ids = {}
for i = 1, count do
  message_ids[i] = ARGV[10 + (i - 1) * stride + m_at]
end
local function lookup(bucket)
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
local in_current = lookup(KEYS[2])
local in_previous = {}
if redis.call('EXISTS', KEYS[3]) == 1 then
  in_previous = lookup(KEYS[3])
end
local first_in_batch = {} -- message id -> index of its first occurrence appended by this batch
local duplicate_of = {}   -- index -> the stream ID it was first written at, or that first index
local function claim(i, pos, id)
  local n = i + 1
  local earlier = in_current[n] or in_previous[n]
  if not earlier then
    earlier = first_in_batch[message_ids[n]]
    if earlier == nil then
      first_in_batch[message_ids[n]] = n
      return true
    end
  end
  duplicate_of[n] = earlier
  return false
end

local appended = append_messages(KEYS[1], layout, 10, count, producer_id, nil, claim)
local remembered = {}
for i = 1, count do
  if appended.ids[i] then
    remembered[#remembered + 1] = message_ids[i]
    remembered[#remembered + 1] = appended.ids[i]
    if #remembered >= 1000 then
      redis.call('HSET', KEYS[2], unpack(remembered))
      remembered = {}
    end
  end
end
if #remembered > 0 then
  redis.call('HSET', KEYS[2], unpack(remembered))
end
local flags = {}
local result = {'', appended.first or ''}
for i = 1, count do
  if appended.ids[i] then
    flags[i] = '0'
  else
    flags[i] = '1'
    local earlier = duplicate_of[i]
    if type(earlier) == 'number' then
      earlier = appended.ids[earlier]
    end
    result[#result + 1] = earlier
  end
end
if batch_no == expected then
  redis.call('HSET', KEYS[4], 'batch', ARGV[7])
  redis.call('PEXPIRE', KEYS[4], ARGV[9])
end
if appended.count > 0 then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  trim_retention(KEYS[1], appended.last, tonumber(ARGV[3]), tonumber(ARGV[4]))
end
result[1] = table.concat(flags)
return result
