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

-- bad_setting(name, arg, minimum): an error reply text if ARGV value `arg` (a topic's retention,
-- dedup window or state TTL) is not a whole number from minimum to 2^53 - 1, else nil. The scripts
-- check these before anything is written: XTRIM and PEXPIRE refuse such a value, and they run
-- after the XADDs, which would leave a batch written behind an error reply. 2^53 - 1 is the
-- largest integer a Lua number (a double) holds exactly (redisq.topic.MAX_TOPIC_SETTING).
local function bad_setting(name, arg, minimum)
  if #arg <= 16 and string.find(arg, '^%d+$') then
    local n = tonumber(arg)
    if n >= minimum and n <= 9007199254740991 then
      return nil
    end
  end
  return 'INVALID_CONFIG ' .. name .. '=' .. string.sub(arg, 1, 40) .. ' is out of range: '
    .. minimum .. '..2^53-1'
end

-- append_messages(stream, layout, first, count, producer_id, seq_first, claim)
--   Appends `count` messages whose arguments start at ARGV[first], #layout arguments each.
--   producer_id (or nil) is stored as field p; with seq_first, field s = ARGV[seq_first + i]
--   (the client sends the sequence numbers as strings: converting numbers here costs more).
--   claim(i) (or nil) is asked before message i is appended; a false answer leaves the
--   message out (a duplicate).
--   Returns {first = ID, last = ID, count = appended, ids = {[i + 1] = ID of message i}}; ids
--   is only filled when claim is given (the other callers need first and last).
--
-- The first XADD takes `*`, so the server picks the millisecond exactly as for any XADD (now, or
-- the last generated ID's if the clock is behind); every later one takes `<that ms>-*`, the next
-- sequence of the same millisecond. Nothing else runs inside a script, so a batch's IDs are
-- consecutive: producer state only needs the first ID and the count. No ID is formatted here
-- and the stream is not inspected: per message, the XADD is the only work.
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

  local argv, call = ARGV, redis.call
  -- The shapes the producers send most name every field in one call: no per-message unpack of
  -- `extra` (about 3% of the server's time per message, measured).
  local shape = layout .. '/' .. (producer_id and 'p' or '') .. (seq_first and 's' or '')
  local id_arg = '*'
  local first_id, id
  local appended = 0
  local ids = {}
  for i = 0, count - 1 do
    local pos = first + i * stride
    if not claim or claim(i) then
      if shape == 'kv/ps' then
        id = call('XADD', stream, id_arg, 'k', argv[pos], 'v', argv[pos + 1], 'p', producer_id,
          's', argv[seq_first + i])
      elseif shape == 'v/ps' then
        id = call('XADD', stream, id_arg, 'v', argv[pos], 'p', producer_id, 's', argv[seq_first + i])
      elseif shape == 'kvm/p' then
        id = call('XADD', stream, id_arg, 'k', argv[pos], 'v', argv[pos + 1], 'm', argv[pos + 2],
          'p', producer_id)
      elseif shape == 'kv/p' then
        id = call('XADD', stream, id_arg, 'k', argv[pos], 'v', argv[pos + 1], 'p', producer_id)
      else
        if seq_at then
          extra[seq_at] = argv[seq_first + i]
        end
        if layout == 'kv' then
          id = call('XADD', stream, id_arg, 'k', argv[pos], 'v', argv[pos + 1], unpack(extra))
        elseif layout == 'v' then
          id = call('XADD', stream, id_arg, 'v', argv[pos], unpack(extra))
        elseif layout == 'kvm' then
          id = call('XADD', stream, id_arg, 'k', argv[pos], 'v', argv[pos + 1], 'm', argv[pos + 2],
            unpack(extra))
        elseif layout == 'vm' then
          id = call('XADD', stream, id_arg, 'v', argv[pos], 'm', argv[pos + 1], unpack(extra))
        else
          local fields = {}
          local n = 0
          for j = 1, stride do
            local arg = argv[pos + j - 1]
            if letters[j] == 'v' or arg ~= '' then
              fields[n + 1] = letters[j]
              fields[n + 2] = arg
              n = n + 2
            end
          end
          for j = 1, #extra do
            fields[n + j] = extra[j]
          end
          id = call('XADD', stream, id_arg, unpack(fields))
        end
      end
      if appended == 0 then
        first_id = id
        id_arg = string.match(id, '^%d+') .. '-*'
      end
      appended = appended + 1
      if claim then
        ids[i + 1] = id
      end
    end
  end
  return {count = appended, ids = ids, first = first_id, last = id}
end

-- count_appended(counts, messages, entries): on a topic of batch entries the hash `counts`
--   (<ns>:{<topic>:<p>}:count, DESIGN §14.6) holds m, the messages, and e, the entries redisq
--   appended to the partition; these are added. Returns m before them (a batch entry's c).
local function count_appended(counts, messages, entries)
  redis.call('HINCRBY', counts, 'e', entries)
  return redis.call('HINCRBY', counts, 'm', messages) - messages
end

-- append_batch(stream, blob, count, producer_id, base_seq, counts): one batch entry (DESIGN §14)
--   of `count` messages (ASCII decimal, as sent): fields b (the client's blob), n, c (the
--   messages appended before it, from counts: count_appended), p and s when given. XADD takes
--   `*` as any XADD does; XSETID then moves the stream's last ID to the batch's last offset
--   <ms>-<seq + count - 1>, so the next entry of anyone (redisq or another client) gets an ID
--   after every offset of this one. Returns {count, first, last} as append_messages does, or nil
--   (nothing written, nothing counted) when the offsets would pass the last stream ID of the
--   millisecond.
local function append_batch(stream, blob, count, producer_id, base_seq, counts)
  local call = redis.call
  local n = tonumber(count)
  local before = string.format('%.0f', count_appended(counts, n, 1))
  local id
  if base_seq then
    id = call('XADD', stream, '*', 'b', blob, 'n', count, 'c', before, 'p', producer_id,
      's', base_seq)
  elseif producer_id then
    id = call('XADD', stream, '*', 'b', blob, 'n', count, 'c', before, 'p', producer_id)
  else
    id = call('XADD', stream, '*', 'b', blob, 'n', count, 'c', before)
  end
  local last = id
  if n > 1 then
    local ms, seq = string.match(id, '^(%d+)-(%d+)$')
    -- A sequence this large only follows a foreign XADD with an explicit ID; a double holds
    -- every integer below 2^53 exactly, and the entry must not claim offsets it cannot have.
    if #seq > 15 then
      call('XDEL', stream, id)
      count_appended(counts, -n, -1)
      return nil
    end
    last = ms .. '-' .. string.format('%.0f', tonumber(seq) + n - 1)
    call('XSETID', stream, last)
  end
  return {count = n, first = id, last = last}
end

-- repack_batch(blob, keep): the blob (model/batches.py, version 1) of the messages of `blob`
--   (one the client packed) without message i when keep(i) is false; and its count. Only a
--   batch with duplicates is repacked: the blob of one without is written as it came.
local function repack_batch(blob, keep)
  local unpack1, pack = struct.unpack, struct.pack
  local _, flags, n = unpack1('>BBI4', blob)
  local function has(flag)
    return math.floor(flags / flag) % 2 == 1
  end
  local columns = 1
  for _, flag in ipairs({1, 2, 4}) do
    if has(flag) then
      columns = columns + 1
    end
  end
  local lengths = {}
  local pos = 7
  for j = 1, n * columns do
    lengths[j] = unpack1('>I4', blob, pos)
    pos = pos + 4
  end
  local stamps_at = pos
  if has(8) then
    pos = pos + 8 * n
  end
  local kept, new_lengths, stamps, data = 0, {}, {}, {}
  for i = 0, n - 1 do
    if keep(i) then
      kept = kept + 1
      if has(8) then
        stamps[kept] = string.sub(blob, stamps_at + 8 * i, stamps_at + 8 * i + 7)
      end
    end
  end
  for c = 0, columns - 1 do
    local column = {}
    for i = 0, n - 1 do
      local length = lengths[c * n + i + 1]
      if keep(i) then
        new_lengths[#new_lengths + 1] = pack('>I4', length)
        column[#column + 1] = string.sub(blob, pos, pos + length - 1)
      end
      pos = pos + length
    end
    data[c + 1] = table.concat(column)
  end
  return pack('>BBI4', 1, flags, kept) .. table.concat(new_lengths) .. table.concat(stamps) ..
    table.concat(data), kept
end

-- batch_maxlen(stream, maxlen, counts, count): retention by count on a partition of batch entries,
-- where MAXLEN counts entries: about maxlen messages, in whole entries, at the messages per entry
-- the partition holds now (m of counts minus the c of its first entry, over its length; a first
-- entry without c, written before the counters or a delayed message's, takes the average of every
-- entry counted), or at this batch's size (count) when that is smaller: after large batches,
-- small ones are kept by the number they need, not by the old average (too many is kept for a
-- while rather than too few). Nothing counted: one message per entry.
local function batch_maxlen(stream, maxlen, counts, count)
  if maxlen <= 0 then
    return 0
  end
  local call = redis.call
  local got = call('HMGET', counts, 'm', 'e')
  local m, e = tonumber(got[1]), tonumber(got[2])
  if not m or not e or m <= 0 or e <= 0 then
    return maxlen
  end
  local per_entry = m / e
  local first = call('XRANGE', stream, '-', '+', 'COUNT', 1)[1]
  if first then
    local fields = first[2]
    for i = 1, #fields, 2 do
      if fields[i] == 'c' then
        local before = tonumber(fields[i + 1])
        local length = call('XLEN', stream)
        if before and before < m and length > 0 then
          per_entry = (m - before) / length
        end
        break
      end
    end
  end
  per_entry = math.max(math.min(per_entry, count), 1)
  return math.ceil(maxlen / per_entry)
end

-- Retention: by count (MAXLEN ~) and by age (MINID ~ now - retention). Approximate trimming only
-- drops whole stream nodes, which keeps it O(1) amortised per batch. produce_message_id.lua trims
-- by age exactly instead (trim_expired, before it appends) and passes retention_ms 0 here.
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

-- trim_expired(stream, now_ms, retention_ms): drop every entry older than now - retention_ms,
-- exactly (MINID without ~, so also the older part of a stream node). A message id's window runs
-- by the clock; this keeps a message from outliving its id on a partition that nobody wrote to
-- for a while. The work is what expired since the last write (each entry is trimmed once), plus
-- a walk over the head node's entries already marked deleted (at most one node's worth).
local function trim_expired(stream, now_ms, retention_ms)
  if retention_ms > 0 and now_ms > retention_ms then
    redis.call('XTRIM', stream, 'MINID', string.format('%.0f', now_ms - retention_ms))
  end
end
