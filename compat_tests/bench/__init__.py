"""Side-by-side broker benchmarks: hyperkafka against Apache Kafka, tansu and noida-db.

`scripts/bench broker` runs this package (`python -m compat_tests.bench`). It lives in
compat_tests/ because it drives brokers exactly as the compatibility tests do: our broker
through `compat_tests.harness`, the real Kafka broker through `compat_tests.java_tools`
(`KafkaOracle`), and the same pinned clients; a second copy of that machinery under
scripts/ would drift. Modules:

- `client`: the load generators (confluent-kafka / librdkafka), one child process each;
- `targets`: the brokers under test, peers installed into their own venvs;
- `procfs`: RSS and CPU time of a broker's process tree, from /proc;
- `runner`: the workloads, medians, the table, the JSON and the PNG chart.

Imports the standard library, confluent-kafka (clients only), matplotlib (chart only) and
compat_tests; never `broker` or `storage`, which it runs as a separate process.
"""
