"""The Kafka wire codec: bytes in, typed messages out. No I/O, no trio, no storage."""
