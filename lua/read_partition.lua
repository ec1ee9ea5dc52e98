--[[ read_partition: the lease holder acks what it handled and reads the next new entries.

KEYS[1]  the partition stream      <ns>:{<topic>:<p>}:log
KEYS[2]  the lease key             <ns>:{<topic>:<p>}:lease:<group>
ARGV[1]  group name
ARGV[2]  consumer (member) name
ARGV[3]  the holder's lease value
ARGV[4]  count: at most this many entries
ARGV[5...] entry IDs to XACK first (may be none)

Acking and reading in one call halves the round trips of the orderly hot path, and the lease
check covers both: a fenced member can neither ack nor pull entries into its pending list.

Returns {acked, tail, entries}: entries as XREADGROUP gives them ({id, {field, value, ...}});
when there are none, tail is the ID of the stream's last entry (the client then waits with
XREAD BLOCK from there), else "".
Error replies
  LEASE_LOST   the lease is gone or held by another grant: nothing acked, nothing read
]]
-- #include includes/group.lua

if not lease_holder(KEYS[2], ARGV[3]) then
  return redis.error_reply('LEASE_LOST partition lease is held by another grant')
end
local acked = 0
if #ARGV >= 5 then
  acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 5))
end
local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[4],
  'STREAMS', KEYS[1], '>')
if reply and reply[1] and #reply[1][2] > 0 then
  return {acked, '', reply[1][2]}
end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local tail = '0-0'
if last[1] then
  tail = last[1][1]
end
return {acked, tail, {}}
