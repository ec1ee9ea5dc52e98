-- includes/producer_id.lua: the PID registered in a name's hash, handed out once from the
-- namespace's PID counter and then kept (shared by init_producer and producer_id_for_name).
local function registered_producer_id(name_key, counter_key)
  local pid = redis.call('HGET', name_key, 'pid')
  if not pid then
    pid = redis.call('INCR', counter_key)
    redis.call('HSET', name_key, 'pid', pid)
  end
  return tonumber(pid)
end
