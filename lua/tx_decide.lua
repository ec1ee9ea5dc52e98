--[[ tx_decide: commit, abort or give up on a transaction, once and for all.

KEYS[1]  the transaction's record, a hash                <ns>:{~tx:<id>}:record
KEYS[2]  the transaction's staged batches, a list        <ns>:{~tx:<id>}:messages
ARGV[1]  the decision: "committed", "aborted" or "unresolved" (check-back gave up)
ARGV[2]  the deciding producer's epoch ("" for recovery: the sweeper, a check-back, a new
         instance of the producer, which may only abort or complete what is open)
ARGV[3]  input positions to commit with it, as the client serialized them ("" for none)
ARGV[4]  "1" when a check-back asked (the record counts the checks)
ARGV[5]  "1" when the deciding producer staged batches: the record must then exist (a record
         that expired, long after its transaction timed out, must not let a paused producer
         commit the batches it still holds)

The decision is written once and is final: the same decision again answers it again (a retry
after a lost reply), another one is refused. Committed messages are then rolled forward into
their partitions through the idempotent append (the client, per partition); aborted and
unresolved ones never reach a partition. A decided transaction's keys no longer expire (an open
one's do, tx_stage.lua): they stay until it is carried out.

Returns the decision now stored.
Error replies
  TX_DECIDED state=<state>             another decision was stored first
  PRODUCER_FENCED stored=<e> got=<e>   the deciding instance is not the one that opened it
]]
local record = redis.call('HMGET', KEYS[1], 'state', 'epoch')
local now = redis.call('TIME')
local now_ms = string.format('%.0f', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
if ARGV[4] == '1' then
  redis.call('HINCRBY', KEYS[1], 'checks', 1)
  redis.call('HSET', KEYS[1], 'checked_ms', now_ms)
end
if not record[1] then
  -- Nothing was staged. Recovery (no epoch) finds a transaction it knows nothing of: aborted,
  -- so a late batch of a paused producer is refused. Its producer may commit it (only input
  -- positions, or nothing).
  if ARGV[1] == 'committed' and (ARGV[2] == '' or ARGV[5] == '1') then
    return redis.error_reply('TX_DECIDED state=missing')
  end
  redis.call('HSET', KEYS[1], 'state', ARGV[1], 'decided_ms', now_ms)
  if ARGV[2] ~= '' then
    redis.call('HSET', KEYS[1], 'epoch', ARGV[2])
  end
  if ARGV[3] ~= '' then
    redis.call('HSET', KEYS[1], 'positions', ARGV[3])
  end
  return ARGV[1]
end
if record[1] == ARGV[1] then
  return ARGV[1]
end
if record[1] ~= 'open' then
  return redis.error_reply('TX_DECIDED state=' .. record[1])
end
if ARGV[2] ~= '' and record[2] and record[2] ~= ARGV[2] then
  return redis.error_reply('PRODUCER_FENCED stored=' .. record[2] .. ' got=' .. ARGV[2])
end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'decided_ms', now_ms)
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'positions', ARGV[3])
end
redis.call('PERSIST', KEYS[1])
redis.call('PERSIST', KEYS[2])
return ARGV[1]
