--[[ extend_lease: renew a lease only while the caller still holds it.

KEYS[1]  the lease key (a string holding the holder's token)
ARGV[1]  the holder's token
ARGV[2]  lease ttl in ms

Returns 1 if renewed, 0 if the lease is gone or held by someone else.
Error replies: none of its own.
]]
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
