--[[ tx_hold: a consumer's input partition joins a transaction (consume-transform-produce):
while the lease is still the caller's, record that a transaction may commit its position.

KEYS[1]  the lease key                         <ns>:{<topic>:<p>}:lease:<group>
KEYS[2]  the group's partition state hash      <ns>:{<topic>:<p>}:gstate:<group>
KEYS[3]  the group's parked keys hash          <ns>:{<topic>:<p>}:parked:<group>
KEYS[4]  the group's held messages hash        <ns>:{<topic>:<p>}:held:<group>
         (KEYS[3] and KEYS[4] only when P, H or U is above 0, as in commit_position.lua)
ARGV[1]  the holder's lease value
ARGV[2]  transaction id
ARGV[3]  the hold's number among its lease's commits (commit_position.lua's ARGV[8])
ARGV[4]  P: keys parked since the last commit; ARGV[5] H: messages held back behind a parked key;
ARGV[6]  U: held messages handled since; then the pairs and offsets, as commit_position.lua

A new owner of the partition finds pending_tx in the state when its lease is granted and
resolves it (tx_position.lua) before it reads: the position a committed transaction carries is
applied once, whoever holds the partition by then, and never overtaken by a redelivery.

The held messages (and parked keys) the position will pass are recorded here, before the
transaction can commit: a position that passed a held message nobody recorded would lose it (a
crash before the next plain commit). Recorded early, a held message the position does not pass
(the transaction aborts) is held again when it is read again: recording is idempotent.

The hold is numbered as the lease's commits are, after every plain commit the owner took before
the transaction took the position: a plain commit that lands after the hold (a late copy whose
answer timed out, or one overtaken on the wire) changes nothing, so it cannot move the group's
position back behind the transaction's once that is applied (its inputs handled twice).

Returns 1.
Error replies
  LEASE_LOST   the lease is gone or held by another grant: the transaction must abort
]]
-- #include includes/group.lua

if not lease_holder(KEYS[1], ARGV[1]) then
  return redis.error_reply('LEASE_LOST partition lease is held by another grant')
end
redis.call('HSET', KEYS[2], 'pending_tx', ARGV[2])
take_commit_number(KEYS[2], ARGV[1], tonumber(ARGV[3]))
record_parked(KEYS[3], KEYS[4], 4)
return 1
