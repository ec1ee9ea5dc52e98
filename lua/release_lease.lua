--[[ release_lease: delete a lease only while the caller still holds it.

KEYS[1]  the lease key (a string holding the holder's token)
ARGV[1]  the holder's token

Returns 1 if released, 0 if the lease was gone or held by someone else.
Error replies: none of its own.
]]
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
