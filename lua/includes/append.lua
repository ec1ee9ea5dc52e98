-- includes/append.lua: shared by the produce scripts (flattened into them at load time).
--
-- Per-message ARGV layout: the letters of `layout` name the per-message arguments, in order
-- (the client sends no empty key, so the fast paths below need no check):
--   k  key          (empty string: no key, the field is omitted)
--   v  value
--   h  headers blob (empty string: no headers, the field is omitted)
--   m  message id
-- Stream entry fields: k, v, h, m as above, plus p (producer id) and s (sequence) when given.

-- server_now_ms(): the server's clock (TIME) in ms: the only clock the scripts trust, so clients
-- with skewed clocks still agree on dedup windows and stream IDs.
local function server_now_ms()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- append_messages(stream, layout, first, count, producer_id, seq_first, claim)
--   Appends `count` messages whose arguments start at ARGV[first], #layout arguments each.
--   producer_id (or nil) is stored as field p; with seq_first, field s = ARGV[seq_first + i]
--   (the client sends the sequence numbers as strings: converting numbers here costs more).
--   claim(i, pos, id) (or nil) is asked before message i is appended at ID `id`; a false answer
--   leaves the message out (a duplicate).
--   Returns {first = ID, last = ID, count = appended, ids = {[i + 1] = ID of message i}}.
--
-- IDs are chosen here as XADD * would (now, or the last generated ID + 1 if the clock is behind)
-- and are consecutive: a batch is always the range first_id + i, so producer state only needs
-- the first ID and the count, and claim() knows a message's ID before it is written.
--
-- The common layouts get a direct redis.call each (no per-message table): this loop is the
-- broker's hot path.
local function append_messages(stream, layout, first, count, producer_id, seq_first, claim)
  local stride = #layout
  local letters = {}
  for j = 1, stride do
    letters[j] = string.sub(layout, j, j)
  end
  local extra = {}
  if producer_id then
    extra[#extra + 1] = 'p'
    extra[#extra + 1] = producer_id
  end
  local seq_at = nil
  if seq_first then
    extra[#extra + 1] = 's'
    extra[#extra + 1] = ''
    seq_at = #extra
  end

  local info = redis.call('XINFO', 'STREAM', stream)
  local last_id = '0-0'
  for j = 1, #info, 2 do
    if info[j] == 'last-generated-id' then
      last_id = info[j + 1]
      break
    end
  end
  local last_ms, last_seq = string.match(last_id, '^(%d+)-(%d+)$')
  local now_ms = server_now_ms()
  local ms, seq0 = tonumber(last_ms), tonumber(last_seq) + 1
  if now_ms > ms then
    ms, seq0 = now_ms, 0
  end
  local prefix = string.format('%.0f', ms) .. '-'

  local appended = 0
  local ids = {}
  for i = 0, count - 1 do
    local pos = first + i * stride
    local id = prefix .. (seq0 + appended)
    if not claim or claim(i, pos, id) then
      if seq_at then
        extra[seq_at] = ARGV[seq_first + i]
      end
      if layout == 'kv' then
        redis.call('XADD', stream, id, 'k', ARGV[pos], 'v', ARGV[pos + 1], unpack(extra))
      elseif layout == 'v' then
        redis.call('XADD', stream, id, 'v', ARGV[pos], unpack(extra))
      elseif layout == 'kvm' then
        redis.call('XADD', stream, id, 'k', ARGV[pos], 'v', ARGV[pos + 1], 'm', ARGV[pos + 2],
          unpack(extra))
      elseif layout == 'vm' then
        redis.call('XADD', stream, id, 'v', ARGV[pos], 'm', ARGV[pos + 1], unpack(extra))
      else
        local fields = {}
        local n = 0
        for j = 1, stride do
          local arg = ARGV[pos + j - 1]
          if letters[j] == 'v' or arg ~= '' then
            fields[n + 1] = letters[j]
            fields[n + 2] = arg
            n = n + 2
          end
        end
        for j = 1, #extra do
          fields[n + j] = extra[j]
        end
        redis.call('XADD', stream, id, unpack(fields))
      end
      appended = appended + 1
      ids[i + 1] = id
    end
  end
  local result = {count = appended, ids = ids}
  if appended > 0 then
    result.first = prefix .. seq0
    result.last = prefix .. (seq0 + appended - 1)
  end
  return result
end

-- Retention: by count (MAXLEN ~) and by age (MINID ~ now - retention). Approximate trimming only
-- drops whole stream nodes, which keeps it O(1) amortised per batch.
local function trim_retention(stream, last_id, maxlen, retention_ms)
  if maxlen > 0 then
    redis.call('XTRIM', stream, 'MAXLEN', '~', maxlen)
  end
  if retention_ms > 0 and last_id then
    local ms = tonumber(string.match(last_id, '^(%d+)'))
    if ms > retention_ms then
      redis.call('XTRIM', stream, 'MINID', '~', string.format('%.0f', ms - retention_ms))
    end
  end
end
