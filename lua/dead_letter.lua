--[[ dead_letter: after the message was written to the dead-letter topic, ack it on its partition,
count it, and (policy park_key) park its key.

KEYS[1]  the partition stream                  <ns>:{<topic>:<p>}:log
KEYS[2]  the lease key                         <ns>:{<topic>:<p>}:lease:<group>
KEYS[3]  the group's partition state hash      <ns>:{<topic>:<p>}:gstate:<group>
KEYS[4]  the group's parked keys hash          <ns>:{<topic>:<p>}:parked:<group>
ARGV[1]  group name
ARGV[2]  the holder's lease value ("" in concurrent mode: no lease check)
ARGV[3]  entry ID of the dead-lettered message, or "" for a message of a batch entry whose other
         messages are not all settled yet (the entry is acked with its last one: it is counted
         now, and acked later)
ARGV[4]  message key to park ("" parks nothing)

The dead-letter topic lives in other slots, so the copy is written first (idempotently: its
message id is the source coordinates) and this script runs second; a crash in between only
repeats the copy, which the dead-letter topic's dedup drops.

Returns 1 if the entry was acknowledged now, 0 if it had been already.
Error replies
  LEASE_LOST   the lease is gone or held by another grant: nothing changed
]]
-- #include includes/group.lua

if not lease_holder(KEYS[2], ARGV[2]) then
  return redis.error_reply('LEASE_LOST partition lease is held by another grant')
end
local acked = 0
if ARGV[3] ~= '' then
  acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
end
if acked == 1 or ARGV[3] == '' then
  redis.call('HINCRBY', KEYS[3], 'dead_letters', 1)
end
redis.call('HDEL', KEYS[3], 'blocked_offset', 'blocked_error', 'blocked_attempts')
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[4], ARGV[4], ARGV[3])
end
return acked
