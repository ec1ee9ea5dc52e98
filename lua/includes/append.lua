-- includes/append.lua: shared by the produce scripts (flattened into them at load time).
--
-- Per-message ARGV layout: the letters of `layout` name the per-message arguments, in order:
--   k  key          (empty string: no key, the field is omitted)
--   v  value
--   h  headers blob (empty string: no headers, the field is omitted)
--   m  message id
-- Stream entry fields: k, v, h, m as above, plus p (producer id) and s (sequence) when given.

local function message_fields(layout_letters, stride, pos, producer_id, sequence)
  local fields = {}
  local n = 0
  for j = 1, stride do
    local letter = layout_letters[j]
    local arg = ARGV[pos + j - 1]
    if letter == 'v' or arg ~= '' then
      fields[n + 1] = letter
      fields[n + 2] = arg
      n = n + 2
    end
  end
  if producer_id then
    fields[n + 1] = 'p'
    fields[n + 2] = producer_id
    n = n + 2
  end
  if sequence then
    fields[n + 1] = 's'
    fields[n + 2] = string.format('%.0f', sequence)
  end
  return fields
end

local function layout_letters_of(layout)
  local letters = {}
  for j = 1, #layout do
    letters[j] = string.sub(layout, j, j)
  end
  return letters
end

-- Appends with consecutive stream IDs: the first XADD picks <ms>-<seq> with '*', the next ones
-- use <ms>-<seq+i> explicitly, so a batch is always the contiguous range first_id + i and the
-- producer state only needs to remember the first ID and the count.
local function new_appender(stream)
  local appender = {count = 0}
  function appender.add(fields)
    local id
    if appender.count == 0 then
      id = redis.call('XADD', stream, '*', unpack(fields))
      local ms, seq = string.match(id, '^(%d+)-(%d+)$')
      appender.ms = ms
      appender.seq = tonumber(seq)
      appender.first = id
    else
      id = appender.ms .. '-' .. string.format('%.0f', appender.seq + appender.count)
      redis.call('XADD', stream, id, unpack(fields))
    end
    appender.count = appender.count + 1
    appender.last = id
    return id
  end
  return appender
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
