--[[ count_range: count the entries of a stream in [start, end), up to a limit, and name the last.

The Spark reader plans rate-limited micro-batches (maxOffsetsPerTrigger) with it: the entries are
scanned inside the server, so only two values cross the network whatever the range holds.

KEYS[1]  partition stream                          <ns>:{<topic>:<p>}:log
ARGV[1]  start: first stream ID of the range (inclusive)
ARGV[2]  end: stream ID that ends the range (exclusive), or "+": no end
ARGV[3]  limit: count at most this many entries (> 0)
ARGV[4]  optional, "messages": count messages, not entries (DESIGN §14): a batch entry (first
         field b, no v, a decimal n) counts its n messages at offsets ms-(s+i); the range's
         offsets are message offsets, so a batch entry that holds start (begun before it) counts
         from start, one that holds end counts up to it, and the limit may stop inside an entry.
         Any other entry counts one. Start must not be exclusive ("(") in this mode.

Returns {count, last_id}: last_id is the ID of the last entry counted ("" when count is 0); with
"messages", the offset of the last message counted.
Error replies: none of its own (a missing stream counts 0).
]]
local limit = tonumber(ARGV[3])
local upper = ARGV[2] == '+' and '+' or '(' .. ARGV[2]
local messages = ARGV[4] == 'messages'
local cursor = ARGV[1]
local last_id = ''
local count = 0

local function split(id)
  local dash = string.find(id, '-', 1, true)
  return string.sub(id, 1, dash - 1), tonumber(string.sub(id, dash + 1))
end

-- A batch entry's message count, or nil for an entry of one offset.
local function batch_count(fields)
  if fields[1] ~= 'b' then
    return nil
  end
  local n
  for i = 1, #fields, 2 do
    if fields[i] == 'v' then
      return nil
    end
    if fields[i] == 'n' then
      n = fields[i + 1]
    end
  end
  if not n or not string.match(n, '^%d+$') or #n > 10 or tonumber(n) < 1 then
    return nil
  end
  return tonumber(n)
end

local end_ms, end_seq
if messages and ARGV[2] ~= '+' then
  end_ms, end_seq = split(ARGV[2])
end

-- Count an entry's messages from sequence `from` (nil: its first) up to the end and the limit.
local function take(entry, from)
  local n = messages and batch_count(entry[2])
  if not n then
    count = count + 1
    last_id = entry[1]
    return
  end
  local ms, s = split(entry[1])
  local lo = from or s
  local hi = s + n
  if end_ms == ms and end_seq < hi then
    hi = end_seq
  end
  if hi - lo > limit - count then
    hi = lo + (limit - count)
  end
  if hi > lo then
    count = count + (hi - lo)
    last_id = ms .. '-' .. string.format('%d', hi - 1)
  end
end

if messages then
  local start_ms, start_seq = split(ARGV[1])
  if start_seq > 0 then
    local before = redis.call('XREVRANGE', KEYS[1], ARGV[1], '-', 'COUNT', 1)[1]
    if before and before[1] ~= ARGV[1] and split(before[1]) == start_ms then
      if batch_count(before[2]) then
        take(before, start_seq)
      end
    end
  end
end

while count < limit do
  local chunk = math.min(1000, limit - count)
  local entries = redis.call('XRANGE', KEYS[1], cursor, upper, 'COUNT', chunk)
  local n = #entries
  if n == 0 then
    break
  end
  for i = 1, n do
    take(entries[i], nil)
    if count >= limit then
      break
    end
  end
  local last_entry = entries[n][1]
  if n < chunk or last_entry == '18446744073709551615-18446744073709551615' then
    break  -- (nothing follows the largest stream ID, and no range may start after it)
  end
  cursor = '(' .. last_entry
end
return {count, last_id}
