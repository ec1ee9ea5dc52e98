--[[ tx_finish: a decided transaction is fully carried out: forget it in the registry.

KEYS[1]  the named producer's registration (any key of the slot when anonymous)
KEYS[2]  the open transactions, a zset                 <ns>:{<ns>}:transactions
KEYS[3]  the transactional group's zset (any key of the slot when there is no group)
ARGV[1]  transaction id
ARGV[2]  "1" when KEYS[1] is a named producer's registration

Returns 1.
Error replies: none of its own.
]]
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if ARGV[2] == '1' and redis.call('HGET', KEYS[1], 'tx') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'tx')
end
return 1
