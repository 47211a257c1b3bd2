"""The project's own attack suite: hostile bytes against a real broker process.

Every attack runs against a broker started for it (`guard.Guard`) while a well-behaved
idempotent producer writes with acks=all in a child process. An attack fails the test when
the broker exits, a request or the good producer hangs past a deadline, the broker's RSS or
file-descriptor count passes the bound the test states, a malformed batch can be read back
from any partition, `hyperkafka verify` fails on the data dir, or a record the good producer
got an acknowledgement for cannot be read back.

Modules:
- `wire`: raw-socket Kafka requests through our codec (kio), and the strict read-back.
- `guard`: the broker, the good producer, the RSS/fd sampler and the final checks.
- `goodclient`: the good producer and the stock consumer (confluent-kafka), as a process.
- `schema_fuzz`: request generation from kio's schemas, mutation classes, the frame runner.
- `batches`: record batches that lie, and compression bombs.
- `atheris_targets`: coverage-guided fuzz targets over the codec and record validation.
- `__main__`: `python -m compat_tests.attack` (what `scripts/fuzz` runs).

Imports the standard library, kio, the broker's sans-I/O protocol package and
compat_tests.harness; the Kafka client library only in `goodclient`.
"""
