--[[ tx_position: apply (or drop) the input position a decided transaction carries.

KEYS[1]  the partition stream                  <ns>:{<topic>:<p>}:log
KEYS[2]  the group's partition state hash      <ns>:{<topic>:<p>}:gstate:<group>
ARGV[1]  group name
ARGV[2]  transaction id
ARGV[3]  the position to commit ("" when the transaction aborted: only the mark goes)
ARGV[4]  entries_read after it ("" when unknown)

Only while the partition's pending_tx is this transaction (tx_hold.lua): applied once, by the
committing producer or by the partition's next owner, whichever comes first.

Returns 1 if applied now, 0 if it was not pending (already applied, or another transaction).
Error replies: none of its own.
]]
if redis.call('HGET', KEYS[2], 'pending_tx') ~= ARGV[2] then
  return 0
end
if ARGV[3] ~= '' then
  if ARGV[4] ~= '' then
    redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], ARGV[3], 'ENTRIESREAD', ARGV[4])
  else
    redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], ARGV[3])
  end
end
redis.call('HDEL', KEYS[2], 'pending_tx')
return 1
