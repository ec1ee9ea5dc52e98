--[[ ack_barrier: one write on a node that leaves nothing behind, so that WAIT / WAITAOF sent
right after it on the same connection confirms every write made on that node before it.

WAIT waits for the replicas to acknowledge the connection's own last write (WAITAOF likewise for
the fsync); the replication stream (and the AOF) is one ordered log per node, so once this write
is acknowledged, so is everything written before it, on any connection: a batch written in an
earlier round whose retry was answered as a duplicate (it wrote nothing), or a transaction's
staging, decision and roll-forward made on pooled connections. Without a write of its own on the
connection, WAIT would answer at once and confirm nothing.

KEYS[1]  a key that holds the data to confirm (a partition's log, the topics' set, a
         transaction's record): declared so that the cluster runs this where that data is (a
         slot being migrated answers TRYAGAIN rather than sending it to a node without the data)
KEYS[2]  a key of the same slot named for this use only     <KEYS[1]>:barrier
         (set and deleted in one step: it never exists outside the script)

Returns 1.
Error replies
  BARRIER_NO_DATA   KEYS[1] does not exist here: nothing to confirm on this node (nothing written)
]]
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('BARRIER_NO_DATA ' .. KEYS[1])
end
redis.call('SET', KEYS[2], '1')
redis.call('DEL', KEYS[2])
return 1
