-- Redis server time, read on the node that holds the pool (on a cluster, TIME alone may
-- go to any node, and leases are measured by the clock of the node that holds them).
-- KEYS[1] any key of the pool (only routes the call)
-- returns server time, ms.
return server_ms()
