#!/opt/hyperkafka/bin/python
"""The image's HEALTHCHECK: exit 0 when the broker answers a Kafka ApiVersions request.

    hyperkafka-healthcheck [HOST:PORT]

Without an address it asks 127.0.0.1 on the port of the first entry of KAFKA_LISTENERS
(the image sets PLAINTEXT://0.0.0.0:9092). A plaintext listener is needed: on a TLS or
SASL first listener, pass the address of a plaintext one.
"""

from __future__ import annotations

import os
import socket
import struct
import sys


def address(argv: list[str]) -> tuple[str, int]:
    text = (
        argv[0]
        if argv
        else os.environ.get("KAFKA_LISTENERS", "PLAINTEXT://0.0.0.0:9092").split(",")[0]
    )
    text = text.split("://", 1)[-1]
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    return ("127.0.0.1" if host in ("", "0.0.0.0", "::") else host), int(port)


def main() -> int:
    host, port = address(sys.argv[1:])
    try:
        with socket.create_connection((host, port), timeout=2) as s:
            # ApiVersions v0, correlation id 1, client id "healthcheck"
            client = b"healthcheck"
            body = struct.pack(">hhih", 18, 0, 1, len(client)) + client
            s.sendall(struct.pack(">i", len(body)) + body)
            head = b""
            while len(head) < 10:
                chunk = s.recv(10 - len(head))
                if not chunk:
                    break
                head += chunk
    except OSError as exc:
        print(f"hyperkafka: {host}:{port}: {exc}", file=sys.stderr)
        return 1
    if len(head) < 10 or struct.unpack(">ih", head[4:10]) != (1, 0):
        print(f"hyperkafka: {host}:{port} gave no ApiVersions answer", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
