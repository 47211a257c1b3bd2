"""Consumer groups and committed offsets (Kafka's classic group protocol).

- `broker.groups.state`: the pure state machine (no I/O, no trio; time is an argument).
- `broker.groups.records`: Kafka's `__consumer_offsets` key/value formats and batches.
- `broker.groups.offsets`: the offsets archive (the internal topic) and its replay.
- `broker.groups.coordinator`: the Trio driver (timers, parked requests, persistence).

The handlers (broker.handlers.groups) call `node.groups`, a `GroupCoordinator`. This
package imports the node only for typing and never imports the handlers or kio.
"""
