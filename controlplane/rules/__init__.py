"""Rules that are behaviour, kept apart from the schema in `controlplane.contract`.

Pure decisions over contract records, shared so that the router, the sidecar and the fleet
simulator decide alike:

- `request_checks`: the rules a client's request body is checked by, at the router and at
  the sidecar;
- `quotas`: the tenant-quota decisions of the store's Lua scripts, and how a router answers
  a refused charge;
- `credits`: the handoff-credit decisions of the store's Lua scripts, how a router answers
  a refused credit, and the decode budget (and an endpoint's headroom) a pool's snapshot
  allows;
- `fairness`: the KV cost a request is charged and the tenants' virtual counters that the
  router's fair queue and the sidecar's admission queue both order waiting requests by.
"""
