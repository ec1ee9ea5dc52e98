--[[ commit_position: the lease holder of an orderly group commits what it handled on a partition.

KEYS[1]  the partition stream                  <ns>:{<topic>:<p>}:log
KEYS[2]  the lease key                         <ns>:{<topic>:<p>}:lease:<group>
KEYS[3]  the group's partition state hash      <ns>:{<topic>:<p>}:gstate:<group>
KEYS[4]  the group's parked keys hash          <ns>:{<topic>:<p>}:parked:<group>
KEYS[5]  the group's held messages hash        <ns>:{<topic>:<p>}:held:<group>
         (KEYS[4] and KEYS[5] are declared only when P, H or U is above 0: both are
         usually absent, and a migrating slot refuses a script that declares a missing key)
ARGV[1]  group name
ARGV[2]  the holder's lease value
ARGV[3]  the new position: the offset of the last message handled ("" leaves it)
ARGV[4]  entries_read after it ("" when unknown: XINFO GROUPS then shows no lag)
ARGV[5]  dead letters written since the last commit (a count)
ARGV[6]  malformed entries among them
ARGV[7]  "1" to clear the blocked message shown by describe_group
ARGV[8]  the commit's number among its lease's commits (1, 2, ...)
ARGV[9]  P: keys parked since the last commit (policy park_key)
ARGV[10] H: messages held back behind a parked key since the last commit
ARGV[11] U: held messages handled since the last commit (their key was released)
ARGV[12...] P pairs (key, offset of the dead letter that parked it), H pairs (offset, key),
         U offsets

The position is the Redis consumer group's last-delivered-id (XGROUP SETID), so an orderly group
keeps no pending-entries list: the partition's single owner reads by range from its position,
and a new owner resumes from the committed one. Everything else the commit records (dead-letter
counts, parked keys, held messages) changes with it, atomically and only under the lease, so a
member that lost its lease commits nothing.

A commit whose number is not above the last one applied under the same lease changes nothing:
a late copy (its answer timed out on the client, which sent what it carried again in a later
commit), or a commit overtaken by a transaction's hold of the partition (tx_hold.lua, numbered
after it, whose position passes this one's): the position never goes back to it.

Returns 1, or 0 when the commit's number was not above the last (nothing changed: the client
sends its records again, without its position).
Error replies
  LEASE_LOST   the lease is gone or held by another grant: nothing changed
]]
-- #include includes/group.lua

if not lease_holder(KEYS[2], ARGV[2]) then
  return redis.error_reply('LEASE_LOST partition lease is held by another grant')
end
if not take_commit_number(KEYS[3], ARGV[2], tonumber(ARGV[8])) then
  return 0
end
if ARGV[3] ~= '' then
  if ARGV[4] ~= '' then
    redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], ARGV[3], 'ENTRIESREAD', ARGV[4])
  else
    redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], ARGV[3])
  end
end
if ARGV[5] ~= '0' then
  redis.call('HINCRBY', KEYS[3], 'dead_letters', ARGV[5])
end
if ARGV[6] ~= '0' then
  redis.call('HINCRBY', KEYS[3], 'malformed', ARGV[6])
end
if ARGV[7] == '1' then
  redis.call('HDEL', KEYS[3], 'blocked_offset', 'blocked_error', 'blocked_attempts')
end
record_parked(KEYS[4], KEYS[5], 9)
return 1
