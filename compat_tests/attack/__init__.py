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
- `limits`: runs the broker under a lower RLIMIT_NOFILE (same pid).
- `goodclient`: the good producer and the stock consumer (confluent-kafka), as a process.
- `schema`: kio's schemas walked: entities from values, random valid ones, spans.
- `schema_fuzz`: the mutation classes, the frame runner, the culprit search.
- `run`: the schema fuzzer under a guard, shared by the tests and scripts/fuzz.
- `batches`: record batches that lie, and compression bombs.
- `atheris_targets`: coverage-guided fuzz targets over the codec and record validation;
  their seed corpus is `corpus/<target>/`.
- `__main__`: `python -m compat_tests.attack` (what `scripts/fuzz` runs).

The tests are compat_tests/test_attack_*.py, one per attack class.

Imports the standard library, kio, the broker's sans-I/O protocol package and
compat_tests.harness; the Kafka client library only in `goodclient`.
"""
