-- includes/dedup.lua: a partition's dedup ring (after includes/append.lua, whose server_now_ms it
-- uses), used by produce_message_id.lua.
--
-- Time slices of the dedup window come from the server's clock (TIME), never a client's: slice
-- s = floor(now / window) lives in bucket s % 2, whose field "" records s (no remembered id is
-- empty). A bucket still holding slice s - 2 or older is emptied before it is reused; the other
-- bucket counts while it holds slice s - 1. An id is remembered for at least one window and at
-- most two, whatever the clocks of the clients that send it.

local function dedup_expire(ring)
  redis.call('PEXPIRE', ring.current,
    string.format('%.0f', (ring.slice + 2) * ring.window_ms - ring.now_ms + 1000))
end

-- dedup_ring(bucket0, bucket1, window_ms): the ring as of now:
--   {current = bucket of this slice, previous = the other one, fresh = current was emptied (or
--    is new), previous_valid = previous holds the slice before, slice, now_ms, window_ms}
-- or nil when the current bucket was emptied but cannot be written again: its slot is migrating
-- (a key the script deleted is no longer local there). The caller then returns TRYAGAIN before it
-- writes anything: the ids dropped were stale, and the client retries once the slot has moved.
local function dedup_ring(bucket0, bucket1, window_ms)
  local now_ms = server_now_ms()
  local slice = math.floor(now_ms / window_ms)
  local ring = {now_ms = now_ms, window_ms = window_ms, slice = slice,
    current = (slice % 2 == 0) and bucket0 or bucket1,
    previous = (slice % 2 == 0) and bucket1 or bucket0}
  local held = tonumber(redis.call('HGET', ring.current, ''))
  -- A bucket of a newer slice (the clock went back after a failover) is kept, not emptied.
  ring.fresh = held == nil or held < slice
  if ring.fresh and held ~= nil then
    -- Emptied whole (DEL frees a large bucket far faster than HDEL of its fields), and its slice
    -- marker is written at once, before anything is appended: the one write that can fail here.
    redis.call('DEL', ring.current)
    local marked = redis.pcall('HSET', ring.current, '', string.format('%.0f', slice))
    if type(marked) == 'table' and marked.err then
      return nil
    end
    dedup_expire(ring)  -- kept no longer than a bucket of ids would be (dedup_seal)
  end
  ring.previous_valid = redis.call('HGET', ring.previous, '') == string.format('%.0f', slice - 1)
  return ring
end

-- dedup_seal(ring): after ids were written into ring.current: record its slice and keep it until
-- the end of the next slice (then the ring reuses the bucket for slice + 2).
local function dedup_seal(ring)
  if ring.fresh then
    redis.call('HSET', ring.current, '', string.format('%.0f', ring.slice))
  end
  dedup_expire(ring)
end
