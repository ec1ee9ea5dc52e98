--[[ create_group: create the Redis consumer group on one partition stream unless it exists
(concurrent mode, which takes no leases).

KEYS[1]  the partition stream   <ns>:{<topic>:<p>}:log
ARGV[1]  group name
ARGV[2]  the group's start id ("0" or "<created_ms>-<max seq>")

Returns 1 if created, 0 if it existed.
Error replies
  TOPIC_NOT_FOUND   the partition stream does not exist
]]
-- #include includes/group.lua

if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('TOPIC_NOT_FOUND')
end
return ensure_group(KEYS[1], ARGV[1], ARGV[2])
