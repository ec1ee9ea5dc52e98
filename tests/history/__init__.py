"""A Jepsen-style history checker for redisq, and the fault drivers that feed it.

Producers and consumers run as separate processes (`python -m tests.history.worker ...`); each
appends one JSON line per event to a history file of its own (recorder.py). Fault drivers
(faults.py, proxy.py, cluster.py) record what they did and when. After a run, checker.py reads
every history file and the topic as stored (broker.read of every partition) and checks one
property per function, each returning a list of violations (empty: the property held):

    acknowledged_stored_once    every acknowledged send is stored exactly once, where answered
    key_order_in_log            per (producer instance, key, delay): stored in invoke order
    delivered_not_early         an acknowledged delayed send is appended at or after its due time
    key_order_in_handling       per key: first handlings in log order, each after its predecessor
    one_handler_per_partition   handler calls of one partition never overlap (SIGSTOP excepted)
    all_handled                 every stored message is handled at least once
    no_fenced_writes            nothing of an older instance of a name lands after a newer init

Time: every event carries `wall` (this machine's CLOCK_REALTIME, ms) and, where recorded, the
server's TIME in ms (`server_ms`). Redis stamps stream IDs and expires leases with the same
CLOCK_REALTIME of the same machine, so all three are one clock here; the checker uses server_ms
when an event has it and wall otherwise. Not to the microsecond: Valkey 9's TIME was seen to
step back by 55 us between two calls in a row, so two handler calls of one process are ordered
by that process's monotonic clock (`mono`), which is exact.
"""
