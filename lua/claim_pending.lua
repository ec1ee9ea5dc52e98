--[[ claim_pending: the new lease holder takes over the group's pending entries, in ID order.

KEYS[1]  the partition stream      <ns>:{<topic>:<p>}:log
KEYS[2]  the lease key             <ns>:{<topic>:<p>}:lease:<group>
ARGV[1]  group name
ARGV[2]  consumer (member) name
ARGV[3]  the holder's lease value ("" in concurrent mode: no lease check)
ARGV[4]  cursor: "0-0" to start, then the cursor this script returned
ARGV[5]  count: at most this many entries per call
ARGV[6]  min_idle_ms: 0 for a lease holder (it owns every pending entry of the partition);
         concurrent mode claims only entries idle this long

XAUTOCLAIM moves entries delivered to the previous owner (or to this member before a restart)
to this member. Entries trimmed away meanwhile are dropped from the pending list by Redis.

Returns {next_cursor, entries, deliveries}: entries as XAUTOCLAIM gives them, deliveries[i] the
delivery count of entries[i] after this claim (XPENDING); next_cursor "0-0" means done.
Error replies
  LEASE_LOST   the lease is gone or held by another grant: nothing claimed
]]
-- #include includes/group.lua

if not lease_holder(KEYS[2], ARGV[3]) then
  return redis.error_reply('LEASE_LOST partition lease is held by another grant')
end
local reply = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[6], ARGV[4],
  'COUNT', ARGV[5])
local entries = {}
for _, entry in ipairs(reply[2]) do
  if entry and entry[2] then
    entries[#entries + 1] = entry
  end
end
local deliveries = {}
if #entries > 0 then
  local counts = {}
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], entries[1][1], entries[#entries][1],
    #entries * 2 + 10, ARGV[2])
  for _, row in ipairs(pending) do
    counts[row[1]] = row[4]
  end
  for i, entry in ipairs(entries) do
    deliveries[i] = counts[entry[1]] or 1
  end
end
return {reply[1], entries, deliveries}
