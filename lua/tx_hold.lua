--[[ tx_hold: a consumer's input partition joins a transaction (consume-transform-produce):
while the lease is still the caller's, record that a transaction may commit its position.

KEYS[1]  the lease key                         <ns>:{<topic>:<p>}:lease:<group>
KEYS[2]  the group's partition state hash      <ns>:{<topic>:<p>}:gstate:<group>
ARGV[1]  the holder's lease value
ARGV[2]  transaction id

A new owner of the partition finds pending_tx in the state when its lease is granted and
resolves it (tx_position.lua) before it reads: the position a committed transaction carries is
applied once, whoever holds the partition by then, and never overtaken by a redelivery.

Returns 1.
Error replies
  LEASE_LOST   the lease is gone or held by another grant: the transaction must abort
]]
-- #include includes/group.lua

if not lease_holder(KEYS[1], ARGV[1]) then
  return redis.error_reply('LEASE_LOST partition lease is held by another grant')
end
redis.call('HSET', KEYS[2], 'pending_tx', ARGV[2])
return 1
