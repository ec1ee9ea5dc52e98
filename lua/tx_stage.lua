--[[ tx_stage: stage one batch of a transaction where no consumer reads it.

KEYS[1]  the transaction's record, a hash                <ns>:{~tx:<id>}:record
KEYS[2]  the transaction's staged batches, a list        <ns>:{~tx:<id>}:messages
ARGV[1]  the producer's id (stored with the messages when they are rolled forward)
ARGV[2]  the producer's epoch
ARGV[3]  the transaction timeout in ms (the record's deadline is now + this)
ARGV[4]  the transactional group ("" for none)
ARGV[5]  the staged batch, serialized by the client (topic, partition, layout, count, body)
ARGV[6]  the batch's index in the transaction (0, 1, 2, ...)
ARGV[7]  the producer's name ("" for an anonymous producer)
ARGV[8]  ms until an undecided transaction's keys expire (past its deadline and check-backs:
         what is never registered or never decided cannot stay behind)

The record is created by the first batch: state "open", producer, name, epoch, group, created
and deadline (server time). A batch is staged once: sent again after a lost reply, it is found
at its index and not added twice; a batch after a missing one is refused. A batch after the
decision is refused: a transaction is immutable once decided.

Returns the number of batches staged so far.
Error replies
  TX_DECIDED state=<state>             the transaction was committed or aborted already
  PRODUCER_FENCED stored=<e> got=<e>   another epoch opened this transaction
  OUT_OF_ORDER expected=<n>            batch n is missing: nothing staged
]]
local state = redis.call('HMGET', KEYS[1], 'state', 'epoch')
if state[1] and state[1] ~= 'open' then
  return redis.error_reply('TX_DECIDED state=' .. state[1])
end
if state[2] and state[2] ~= ARGV[2] then
  return redis.error_reply('PRODUCER_FENCED stored=' .. state[2] .. ' got=' .. ARGV[2])
end
if not state[1] then
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  redis.call('HSET', KEYS[1], 'state', 'open', 'producer', ARGV[1], 'name', ARGV[7],
    'epoch', ARGV[2], 'group', ARGV[4], 'created_ms', string.format('%.0f', now_ms),
    'deadline_ms', string.format('%.0f', now_ms + tonumber(ARGV[3])), 'checks', 0)
end
local staged = redis.call('LLEN', KEYS[2])
local index = tonumber(ARGV[6])
if index < staged then
  return staged
end
if index > staged then
  return redis.error_reply('OUT_OF_ORDER expected=' .. staged)
end
local count = redis.call('RPUSH', KEYS[2], ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[8])
redis.call('PEXPIRE', KEYS[2], ARGV[8])
return count
