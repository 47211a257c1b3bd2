"""Transactions (KIP-98, KIP-447, KIP-890 part 1): the transaction coordinator, its
signed `__transaction_state` archive, transaction markers and each partition's last
stable offset. See docs/transactions.md.

- `broker.transactions.coordinator`: `TxnCoordinator`, the state machine (requests, the
  archive, completion, timeouts and expiry), assembled from the two parts below.
- `broker.transactions.shards`: where a transactional id is coordinated, and the
  takeover of partitions of `__transaction_state` in a cluster (`TxnShards`).
- `broker.transactions.markers`: the markers of a transaction's second phase and
  WriteTxnMarkers (`MarkerSender`).
- `broker.transactions.codes`: the error codes and `CoordinatorError`;
  `broker.transactions.records`: the archive's and the markers' record formats;
  `broker.transactions.partition`: each partition's open transactions and last stable
  offset; `broker.transactions.settings`: the coordinator's settings.
"""
