"""Consumer groups and committed offsets (Kafka's classic group protocol and KIP-848's).

- `broker.groups.state`: the pure state machine (no I/O, no trio; time is an argument).
- `broker.groups.consumer_group`: the KIP-848 consumer protocol's pure state machine
  (a `Group` of type consumer holds one); `broker.groups.assignors`: its server-side
  assignors; `broker.groups.consumer_records`: its records of `__consumer_offsets`.
- `broker.groups.records`: Kafka's `__consumer_offsets` key/value formats and batches.
- `broker.groups.offsets`: the offsets archive (the internal topic) and its replay.
- `broker.groups.coordinator`: the Trio driver (timers, parked requests, persistence).

The handlers (broker.handlers.groups) call `node.groups`, a `GroupCoordinator`. This
package imports the node only for typing and never imports the handlers or kio.
"""
