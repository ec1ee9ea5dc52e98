--[[ release_lease: delete a lease only while the caller still holds it.

KEYS[1]  the lease key (a string holding the holder's token)
KEYS[2]  optional: the group's partition state hash   <ns>:{<topic>:<p>}:gstate:<group>
ARGV[1]  the holder's token
ARGV[2]  with KEYS[2], optional ("" for none): the position the lease was granted at, sent by
         an orderly owner that gave out no message. acquire_lease.lua counted its grant as a
         takeover of the message after that position; it made no attempt (a hand-over or close
         before its first read), so the count is taken back: a rebalance is not an attempt.

With KEYS[2], a lease granted to an acquire request (acquire_lease.lua's grant_request and
grant_lease) marks that request given up: a copy of its acquire that arrives late is refused
instead of granting the partition again to a member that has let it go.

Returns 1 if released, 0 if the lease was gone or held by someone else.
Error replies: none of its own.
]]
-- #include includes/group.lua

if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if KEYS[2] then
    local grant = redis.call('HMGET', KEYS[2], 'grant_request', 'grant_lease')
    if grant[1] and grant[2] == ARGV[1] then
      redis.call('HDEL', KEYS[2], 'grant_request', 'grant_lease')
      give_up_request(KEYS[2], grant[1])
    end
    if ARGV[2] ~= '' then
      untried_grant(KEYS[2], ARGV[2])
    end
  end
  return 1
end
return 0
