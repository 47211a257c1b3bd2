"""Transactions (KIP-98, KIP-447, KIP-890 part 1): the transaction coordinator, its
signed `__transaction_state` archive, transaction markers and each partition's last
stable offset. See docs/transactions.md."""
