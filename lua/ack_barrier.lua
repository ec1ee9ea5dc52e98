--[[ ack_barrier: one write on a node that leaves nothing behind, so that WAIT / WAITAOF sent
right after it on the same connection confirms every write made on that node before it.

WAIT waits for the replicas to acknowledge the connection's own last write; the replication
stream (and the AOF) is one ordered log per node, so once this write is acknowledged, so is
everything written before it, on any connection: a transaction's staging, decision and roll-
forward, made on pooled connections.

KEYS[1]  a key of the slot to confirm, named for this use only   <any key of the slot>:barrier
         (set and deleted in one step: it never exists outside the script)

Returns 1.
Error replies: none of its own.
]]
redis.call('SET', KEYS[1], '1')
redis.call('DEL', KEYS[1])
return 1
