--[[ acquire_lease: grant a group's lease on one partition (SET NX PX) with a new fencing token,
and tell the new owner where the group stands on it.

KEYS[1]  the lease key                          <ns>:{<topic>:<p>}:lease:<group>
KEYS[2]  the fencing token counter              <ns>:{<topic>:<p>}:fence:<group>
KEYS[3]  the partition stream                   <ns>:{<topic>:<p>}:log
KEYS[4]  the group's partition state hash       <ns>:{<topic>:<p>}:gstate:<group>
ARGV[1]  group name
ARGV[2]  member name
ARGV[3]  lease_ttl_ms
ARGV[4]  the group's start id ("0" or "<created_ms>-<max seq>"), used if the Redis consumer group
         does not exist on this stream yet
ARGV[5]  optional: the request id, random per acquire attempt of one consumer instance; the
         instance sends the same id again when it got no answer (a connection lost after the
         call was sent)
ARGV[6]  optional: "give_up": the instance no longer wants the partition and gives the
         request up: its grant, if it holds the lease, is released, and a late copy of the
         request is refused from now on. Returns {0, 1} if a grant was released, else {0, 0}.

The lease value is "<token>:<member>:<granted_ms>"; the holder sends it back with every read and
commit, and the scripts compare it whole, so a token from an earlier grant never matches.

An orderly group's position on the partition is its Redis consumer group's last-delivered-id
(committed with commit_position.lua, so XINFO GROUPS shows the truth); the new owner reads on
from there, which hands it whatever the previous owner handled but did not commit.

Grants that start at the same position as the grant before count up (takeovers): the message
after that position has been handed to that many owners that never got past it (a handler
that crashes its process); the new owner starts its attempt count there, so the failure policy
applies even to a message no handler survives.

An attempt whose answer was lost is answered again: when ARGV[5] is the request id of the
grant the lease holds now, that same grant is answered (same value, its ttl restarted), so the
partition does not wait for the lease to run out. Only the instance that made the attempt
knows its id, and it never saw that grant: nothing else can hold it. The state hash keeps the
last grant's request id and lease value (grant_request, grant_lease), and the requests given
up (given_up, see includes/group.lua). A request counts as one
takeover however often it is answered, also when its grant expired unseen and it is granted
anew with no other grant in between (the fencing counter tells).

A transaction of the previous owner may still carry a position for this partition
(consume-transform-produce, tx_hold.lua): its id is answered, and the new owner resolves it
before it reads.

Returns {1, lease value, position, entries_read (-1: unknown), takeovers, pending transaction
id or ""} if granted, {0, current value} if another holder has it.
Error replies
  TOPIC_NOT_FOUND   the partition stream does not exist
]]
-- #include includes/group.lua

local request = ARGV[5] or ''
local current = redis.call('GET', KEYS[1])
local state = redis.call('HMGET', KEYS[4], 'grant_request', 'grant_lease')
local same_request = request ~= '' and state[1] == request
local function token_of(value)
  return tonumber(string.match(value or '', '^(%d+):'))
end
local function group_position()
  local fields = stream_group(KEYS[3], ARGV[1])
  if not fields then
    return '0-0', -1
  end
  local entries_read = -1
  if type(fields['entries-read']) == 'number' then
    entries_read = fields['entries-read']
  end
  return fields['last-delivered-id'], entries_read
end

if ARGV[6] == 'give_up' then
  local released = 0
  if same_request then
    local held = current and current == state[2]
    -- R's grant ran out unseen and nobody was granted since: its count is taken back too.
    local unused = not current and token_of(state[2]) == tonumber(redis.call('GET', KEYS[2]))
    if held or unused then
      if held then
        redis.call('DEL', KEYS[1])
        released = 1
      end
      if redis.call('EXISTS', KEYS[3]) == 1 then
        untried_grant(KEYS[4], (group_position()))
      end
    end
    redis.call('HDEL', KEYS[4], 'grant_request', 'grant_lease')
  end
  if request ~= '' then
    give_up_request(KEYS[4], request)
  end
  return {0, released}
end

if request ~= '' and given_up(KEYS[4], request) then  -- a late copy of a request given up
  return {0, current or ''}
end
if current and not (same_request and state[2] == current) then
  return {0, current}
end
if redis.call('EXISTS', KEYS[3]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end
local value = current
local answered_again = current ~= false
if value then
  redis.call('PEXPIRE', KEYS[1], ARGV[3]) -- answered again: the holder counts its ttl from now
else
  ensure_group(KEYS[3], ARGV[1], ARGV[4])
  local time = redis.call('TIME')
  local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  local token = redis.call('INCR', KEYS[2])
  value = token .. ':' .. ARGV[2] .. ':' .. string.format('%.0f', now_ms)
  redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[3])
  -- The same request granted anew, its earlier grant having run out unseen with no grant since.
  answered_again = same_request and token_of(state[2]) == token - 1
  if request ~= '' then
    redis.call('HSET', KEYS[4], 'grant_request', request, 'grant_lease', value)
  else
    redis.call('HDEL', KEYS[4], 'grant_request', 'grant_lease')
  end
end
local position, entries_read = group_position()
-- Counted only while a message waits after the position: an owner that had one to handle
-- (nothing can follow the largest stream ID, and no exclusive range may start at it).
local takeovers = 0
local largest = '18446744073709551615-18446744073709551615'
if position ~= largest and #redis.call('XRANGE', KEYS[3], '(' .. position, '+', 'COUNT', 1) > 0 then
  if redis.call('HGET', KEYS[4], 'takeover_position') ~= position then
    redis.call('HSET', KEYS[4], 'takeover_position', position, 'takeovers', 0)
  elseif answered_again then
    takeovers = tonumber(redis.call('HGET', KEYS[4], 'takeovers')) or 0
  else
    takeovers = redis.call('HINCRBY', KEYS[4], 'takeovers', 1)
  end
end
local pending_tx = redis.call('HGET', KEYS[4], 'pending_tx') or ''
return {1, value, position, entries_read, takeovers, pending_tx}
