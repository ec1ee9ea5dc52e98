-- includes/group.lua: shared by the consumer-group scripts (flattened into them at load time).

-- ensure_group(stream, group, start_id)
--   Creates the Redis consumer group `group` on `stream` unless it exists. start_id is "0"
--   (earliest) or "<created_ms>-<max seq>" (latest: what was appended after the group was created).
--   For "latest", "$" is used when nothing newer than start_id exists yet: the same position,
--   and Redis then knows entries-read, so XINFO GROUPS can report the lag.
--   Returns 1 if created, 0 if it existed.
local function ensure_group(stream, group, start_id)
  local id = start_id
  if start_id ~= '0' then
    local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
    local last_ms, last_seq = 0, 0
    if last[1] then
      last_ms, last_seq = string.match(last[1][1], '^(%d+)-(%d+)$')
    end
    local start_ms = string.match(start_id, '^(%d+)')
    if tonumber(last_ms) <= tonumber(start_ms) then
      id = '$'
    end
  end
  local ok = redis.pcall('XGROUP', 'CREATE', stream, group, id)
  if type(ok) == 'table' and ok.err then
    if string.find(ok.err, 'BUSYGROUP', 1, true) then
      return 0
    end
    error(ok)
  end
  return 1
end

-- stream_group(stream, group): the fields of `group`'s entry in XINFO GROUPS of `stream` (name,
-- last-delivered-id, entries-read, pending, ...), or nil when the stream has no such group.
local function stream_group(stream, group)
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local fields = {}
    for i = 1, #info, 2 do
      fields[info[i]] = info[i + 1]
    end
    if fields['name'] == group then
      return fields
    end
  end
  return nil
end

-- lease_holder(lease, value): true while `lease` holds exactly `value` ("" skips the check:
-- concurrent mode has no leases).
local function lease_holder(lease, value)
  if value == '' then
    return true
  end
  return redis.call('GET', lease) == value
end

-- take_commit_number(state, lease_value, seq): what an orderly owner writes under its lease
-- (commit_position.lua's commits, tx_hold.lua's holds) is numbered per lease. True when seq is
-- above the last number applied under this lease, which it then becomes; false for a late copy
-- (its answer timed out on the client, which sent what it carried again, numbered anew).
local function take_commit_number(state, lease_value, seq)
  if redis.call('HGET', state, 'commit_lease') == lease_value
      and tonumber(redis.call('HGET', state, 'commit_seq') or '0') >= seq then
    return false
  end
  redis.call('HSET', state, 'commit_lease', lease_value, 'commit_seq', seq)
  return true
end

-- Acquire requests given up (acquire_lease.lua's request ids whose grants were released or
-- given up): a late copy of one is refused. The last GIVEN_UP_KEPT of them are kept, space
-- separated, in the field given_up of the group's partition state hash: a copy that arrives
-- after that many later give-ups or releases of the partition is granted (and its lease then
-- runs out unused).
local GIVEN_UP_KEPT = 16

-- given_up(state, request): true if `request` was given up.
local function given_up(state, request)
  local list = redis.call('HGET', state, 'given_up')
  return list ~= false and string.find(' ' .. list .. ' ', ' ' .. request .. ' ', 1, true) ~= nil
end

-- give_up_request(state, request): remember `request` as given up.
local function give_up_request(state, request)
  local ids = {}
  for id in string.gmatch(redis.call('HGET', state, 'given_up') or '', '%S+') do
    ids[#ids + 1] = id
  end
  ids[#ids + 1] = request
  redis.call('HSET', state, 'given_up', table.concat(ids, ' ', math.max(1, #ids - GIVEN_UP_KEPT + 1)))
end

-- untried_grant(state, position): take back the takeover count of a grant made at `position`
-- that gave out no message (a hand-over, close or give-up before its first read): a rebalance
-- is not an attempt. Nothing to take back if the count is at another position by now; at 0,
-- the grant was the first at its position and the next one starts counting afresh.
local function untried_grant(state, position)
  if redis.call('HGET', state, 'takeover_position') == position then
    if tonumber(redis.call('HGET', state, 'takeovers') or '0') > 0 then
      redis.call('HINCRBY', state, 'takeovers', -1)
    else
      redis.call('HDEL', state, 'takeover_position', 'takeovers')
    end
  end
end

-- record_parked(parked, held, at): what an orderly owner records with a position (commit_position,
-- tx_hold): from ARGV[at], counts P, H, U, then P pairs (key, offset of the dead letter that
-- parked it) into the parked keys hash, H pairs (offset, key) into the held messages hash, and
-- U offsets (held messages handled since: their key was released) out of it.
local function record_parked(parked, held, at)
  local p, h, u = tonumber(ARGV[at]), tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])
  at = at + 3
  for _ = 1, p do
    redis.call('HSET', parked, ARGV[at], ARGV[at + 1])
    at = at + 2
  end
  for _ = 1, h do
    redis.call('HSET', held, ARGV[at], ARGV[at + 1])
    at = at + 2
  end
  for _ = 1, u do
    redis.call('HDEL', held, ARGV[at])
    at = at + 1
  end
end
