--[[ ack: XACK many entries of one partition, only while the caller holds the lease.

KEYS[1]  the partition stream      <ns>:{<topic>:<p>}:log
KEYS[2]  the lease key             <ns>:{<topic>:<p>}:lease:<group>
ARGV[1]  group name
ARGV[2]  the holder's lease value ("" in concurrent mode: no lease check)
ARGV[3...] entry IDs

Returns the number of entries acknowledged (XACK's answer).
Error replies
  LEASE_LOST   the lease is gone or held by another grant: nothing acknowledged
]]
-- #include includes/group.lua

if not lease_holder(KEYS[2], ARGV[2]) then
  return redis.error_reply('LEASE_LOST partition lease is held by another grant')
end
if #ARGV < 3 then
  return 0
end
return redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 3))
