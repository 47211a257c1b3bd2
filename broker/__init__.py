"""hyperkafka's Kafka-facing side: the Trio server, the protocol codec and the handlers.

`broker.protocol` is sans-I/O and imports neither trio, sockets nor `storage`.
"""
