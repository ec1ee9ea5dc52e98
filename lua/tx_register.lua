--[[ tx_register: open a transaction in the namespace's registry (and, for a named producer, prove
its epoch and make this its open transaction).

KEYS[1]  the named producer's registration, a hash {epoch, tx}   <ns>:{<ns>}:producer:<name>
         (any key of the slot for an anonymous producer: it is not touched)
KEYS[2]  the open transactions, a zset (id -> when to look next)  <ns>:{<ns>}:transactions
KEYS[3]  the transactional group's zset (id -> next check-back)  <ns>:{<ns>}:txgroup:<group>
         (any key of the slot when there is no group)
ARGV[1]  transaction id
ARGV[2]  the producer's epoch ("" for an anonymous producer)
ARGV[3]  deadline in ms from now (the transaction timeout: aborted past it if still open)
ARGV[4]  first check-back in ms from now ("" when there is no transactional group)
ARGV[5]  "1": the name's one open transaction (Kafka's transactional.id), recorded in KEYS[1]

A transactional producer (Kafka style) has one open transaction at a time: a new instance of its
name finds it in the registration and aborts or completes it before it writes anything. Half
messages (RocketMQ style) may be open side by side; check-back resolves them.

Returns 1.
Error replies
  PRODUCER_FENCED stored=<e> got=<e>   a newer instance of the name has started
]]
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
if ARGV[2] ~= '' then
  local stored = redis.call('HGET', KEYS[1], 'epoch')
  if stored and stored ~= ARGV[2] then
    return redis.error_reply('PRODUCER_FENCED stored=' .. stored .. ' got=' .. ARGV[2])
  end
  if ARGV[5] == '1' then
    redis.call('HSET', KEYS[1], 'tx', ARGV[1])
  end
end
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), ARGV[1])
if ARGV[4] ~= '' then
  redis.call('ZADD', KEYS[3], now_ms + tonumber(ARGV[4]), ARGV[1])
end
return 1
