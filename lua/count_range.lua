--[[ count_range: count the entries of a stream in [start, end), up to a limit, and name the last.

The Spark reader plans rate-limited micro-batches (maxOffsetsPerTrigger) with it: the entries are
scanned inside the server, so only two values cross the network whatever the range holds.

KEYS[1]  partition stream                          <ns>:{<topic>:<p>}:log
ARGV[1]  start: first stream ID of the range (inclusive)
ARGV[2]  end: stream ID that ends the range (exclusive), or "+": no end
ARGV[3]  limit: count at most this many entries (> 0)

Returns {count, last_id}: last_id is the ID of the last entry counted ("" when count is 0).
Error replies: none of its own (a missing stream counts 0).
]]
local limit = tonumber(ARGV[3])
local upper = ARGV[2] == '+' and '+' or '(' .. ARGV[2]
local cursor = ARGV[1]
local last_id = ''
local count = 0
while count < limit do
  local chunk = math.min(1000, limit - count)
  local entries = redis.call('XRANGE', KEYS[1], cursor, upper, 'COUNT', chunk)
  local n = #entries
  if n == 0 then
    break
  end
  count = count + n
  last_id = entries[n][1]
  if n < chunk or last_id == '18446744073709551615-18446744073709551615' then
    break  -- (nothing follows the largest stream ID, and no range may start after it)
  end
  cursor = '(' .. last_id
end
return {count, last_id}
