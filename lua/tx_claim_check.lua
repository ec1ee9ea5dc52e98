--[[ tx_claim_check: a check-back answer of UNKNOWN takes the transaction's current round, once.

KEYS[1]  the transactional group's zset (id -> next check-back)  <ns>:{<ns>}:txgroup:<group>
ARGV[1]  transaction id
ARGV[2]  the next check-back in ms from now (the check interval)

A round is the transaction being due (its score not later than now). The first answer of the
round reschedules it to now + ARGV[2], so a second checker that asked about the same round
(its lease expired under a slow check) finds it no longer due and counts nothing. The caller
counts the answer (HINCRBY on the transaction's record, another slot) only after a 1 here: a
crash in between loses one answer, which costs one more round, never one fewer.

Returns 1 if the round was due and is now this answer's (rescheduled), 0 if not (the transaction
is gone from the zset, or scheduled later than now: another answer took this round).
Error replies: none of its own.
]]
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then
  return 0
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
if tonumber(score) > now_ms then
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', now_ms + tonumber(ARGV[2]), ARGV[1])
return 1
