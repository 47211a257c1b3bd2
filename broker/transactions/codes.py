"""Kafka's error codes (kafka.common.protocol.Errors) the transaction coordinator answers,
and `CoordinatorError`, which carries one. The handlers' errors module is not imported
here (it would import every handler, and they import the node). Imports nothing."""

from __future__ import annotations

NONE = 0
INVALID_REQUEST = 42
REQUEST_TIMED_OUT = 7
COORDINATOR_NOT_AVAILABLE = 15
INVALID_PRODUCER_EPOCH = 47
KAFKA_STORAGE_ERROR = 56
CONCURRENT_TRANSACTIONS = 51
INVALID_PRODUCER_ID_MAPPING = 49
INVALID_TRANSACTION_TIMEOUT = 50
INVALID_TXN_STATE = 48
PRODUCER_FENCED = 90
TRANSACTIONAL_ID_NOT_FOUND = 105
NOT_COORDINATOR = 16
UNKNOWN_TOPIC_OR_PARTITION = 3
OPERATION_NOT_ATTEMPTED = 55
INVALID_TOPIC_EXCEPTION = 17
NOT_LEADER_OR_FOLLOWER = 6
COORDINATOR_LOAD_IN_PROGRESS = 14
NOT_ENOUGH_REPLICAS = 19  # what Kafka's produce answers while a verification cannot be made
TRANSACTION_COORDINATOR_FENCED = 52  # a marker from an older coordinator epoch than the partition's


class CoordinatorError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
