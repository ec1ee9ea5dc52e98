--[[ producer_id_for_name: the PID registered under a name, handed out once and then kept.

Unlike init_producer, no epoch is bumped and nothing is fenced: every caller with the same name
gets the same PID. The Spark writer uses it so that a retried task (same job or query, same Spark
partition) re-sends its batches under the PID of the first attempt, and the producer window
answers them as duplicates.

KEYS[1]  the name's hash {pid}                     <ns>:{<ns>}:spark-writer:<name>
KEYS[2]  the namespace's PID counter               <ns>:{<ns>}:pid-counter
ARGV[1]  ttl_ms: expiry of the hash, refreshed on every call

Returns the PID (an integer).
Error replies: none of its own.
]]
-- #include includes/producer_id.lua

local pid = registered_producer_id(KEYS[1], KEYS[2])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return pid
