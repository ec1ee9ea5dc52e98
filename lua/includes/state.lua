-- includes/state.lua: a producer's state hash rewritten in place.
--
-- Never DEL then HSET: while the key's slot migrates (MIGRATING), a key the script deleted is no
-- longer local, and writing it again fails mid-script, after the DEL and whatever came before it,
-- which are not rolled back.

-- rewrite_state(key, values): key holds exactly the fields of values (field, value, ...) after.
local function rewrite_state(key, values)
  redis.call('HSET', key, unpack(values))
  local keep = {}
  for i = 1, #values, 2 do
    keep[values[i]] = true
  end
  local stale = {}
  for _, field in ipairs(redis.call('HKEYS', key)) do
    if not keep[field] then
      stale[#stale + 1] = field
    end
  end
  if #stale > 0 then
    redis.call('HDEL', key, unpack(stale))
  end
end
