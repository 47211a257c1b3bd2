"""Jepsen-style tests of cluster mode: brokers and etcd in network namespaces, real clients,
a nemesis (kill -9, SIGSTOP/SIGCONT, silent partitions) and a checker of the histories.

Modules: `net` (namespaces, bridge, nftables cuts), `wire` (requests to one chosen broker),
`cluster` (processes in the hosts), `workload` (the client processes), `archives` (every
broker's copy of a quorum-signed partition, read from its data dir after a run),
`checker` (pure verdicts), `run` (one run: schedule, clients, checks). The tests are
compat_tests/test_jepsen.py; docs/jepsen.md says how to run and read them.
"""
