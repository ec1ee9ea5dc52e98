--[[ reset_position: an administrator moves a group's committed position on one partition (Kafka's
kafka-consumer-groups --reset-offsets; redisq.protocol.offsets), only while no member holds the
partition's lease.

KEYS[1]  the partition stream                  <ns>:{<topic>:<p>}:log
KEYS[2]  the lease key                         <ns>:{<topic>:<p>}:lease:<group>
KEYS[3]  the group's partition state hash      <ns>:{<topic>:<p>}:gstate:<group>
KEYS[4]  the group's held messages hash        <ns>:{<topic>:<p>}:held:<group>
KEYS[5]  the group's settled bitmaps           <ns>:{<topic>:<p>}:settled:<group>
ARGV[1]  group name
ARGV[2]  the position the reset was computed from: the Redis consumer group's last-delivered-id
         as the administrator read it ("" when the stream had no consumer group of that name)
ARGV[3]  the new position: the last entry counted as handled ("0-0": none)
ARGV[4]  entries_read at the new position ("" when unknown: XINFO GROUPS then shows no lag)

Why one script: a member granted the lease loads the committed position (acquire_lease.lua) and
writes its own position back with each commit (commit_position.lua), which checks only its
lease. A reset that looked for leases and then wrote in separate steps was undone by a member
granted in between, after the reset had returned. Here the check and the write are one step:
while a lease is held nothing changes, and a grant after the reset loads the new position.
A reset computed from a position that has moved since it was read (a member committed and left,
a concurrent member read, a transaction applied its position) changes nothing either: its
shifts and lags were computed from the old one.

What a reset writes, all of it or nothing: the position (XGROUP SETID, or XGROUP CREATE on a
stream the group never read), with ENTRIESREAD when known; a concurrent group's pending entries
acknowledged (the new position is the whole truth) and their settled bitmaps dropped; the
blocked message and the takeover count cleared, and a previous owner's transaction that still
carries a position (pending_tx, tx_hold.lua) no longer applies it; held messages at or before
the new position dropped.

Returns {1, pending entries acknowledged} when reset; {0, the lease value} while a lease is held;
{2, the position now ("" without a consumer group)} when it is no longer ARGV[2]. In the last two
nothing changed.
Error replies
  TOPIC_NOT_FOUND   the partition stream does not exist
]]
-- #include includes/group.lua

local lease = redis.call('GET', KEYS[2])
if lease then
  return {0, lease}
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end
local group = stream_group(KEYS[1], ARGV[1])
local now = group and group['last-delivered-id'] or ''
if now ~= ARGV[2] then
  return {2, now}
end

local entries_read = {}
if ARGV[4] ~= '' then
  entries_read = {'ENTRIESREAD', ARGV[4]}
end
local acked = 0
if not group then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], ARGV[3], unpack(entries_read))
else
  if group['pending'] > 0 then
    while true do
      local pending = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1000)
      if #pending == 0 then
        break
      end
      local ids = {}
      for i, entry in ipairs(pending) do
        ids[i] = entry[1]
      end
      acked = acked + redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
    end
    redis.call('DEL', KEYS[5])  -- the settled parts of batch entries no longer pending
  end
  redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], ARGV[3], unpack(entries_read))
end
redis.call('HDEL', KEYS[3], 'blocked_offset', 'blocked_error', 'blocked_attempts',
  'takeover_position', 'takeovers', 'pending_tx')

-- Stream IDs compared part by part as decimal strings (no leading zeros): a part goes up to
-- 2^64 - 1, and a Lua number holds integers exactly only up to 2^53.
local function less(a, b)
  if #a ~= #b then
    return #a < #b
  end
  return a < b
end
local function at_or_before(id, bound_ms, bound_seq)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  if not ms then
    return false -- not an offset: not redisq's, left alone
  end
  if ms ~= bound_ms then
    return less(ms, bound_ms)
  end
  return not less(bound_seq, seq)
end
local bound_ms, bound_seq = string.match(ARGV[3], '^(%d+)-(%d+)$')
local done = {}
for _, offset in ipairs(redis.call('HKEYS', KEYS[4])) do
  if at_or_before(offset, bound_ms, bound_seq) then
    done[#done + 1] = offset
    if #done == 1000 then
      redis.call('HDEL', KEYS[4], unpack(done))
      done = {}
    end
  end
end
if #done > 0 then
  redis.call('HDEL', KEYS[4], unpack(done))
end
return {1, acked}
