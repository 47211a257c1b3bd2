"""ListOffsets through one Python client's consumer API, in its own process.

`python -m compat_tests.workers.listoffsets CLIENT --bootstrap H:P --topic T --at TS...`
with CLIENT kafka-python, confluent or aiokafka asks partition 0 of T for each TS: -2 the
log start (the client's beginning offsets / low watermark), -1 the high watermark (end
offsets / high watermark), a timestamp >= 0 the first offset whose timestamp is >= TS
(offsets_for_times). Prints one JSON line, the shape `hkgo CLIENT admin list-offsets`
prints: {"offsets": {"TS": offset}}, with null where the client reports no offset
(kafka-python and aiokafka answer None, confluent-kafka the offset -1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

LATEST, EARLIEST = -1, -2


def kafka_python(bootstrap: str, topic: str, ats: list[int]) -> dict[int, int | None]:
    from kafka import KafkaConsumer, TopicPartition

    tp = TopicPartition(topic, 0)
    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    try:
        out: dict[int, int | None] = {}
        for at in ats:
            if at == LATEST:
                out[at] = c.end_offsets([tp])[tp]
            elif at == EARLIEST:
                out[at] = c.beginning_offsets([tp])[tp]
            else:
                got = c.offsets_for_times({tp: at})[tp]
                out[at] = None if got is None else got.offset
        return out
    finally:
        c.close()


def confluent(bootstrap: str, topic: str, ats: list[int]) -> dict[int, int | None]:
    import confluent_kafka as ck

    c = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": "hk-compat-listoffsets"})
    try:
        out: dict[int, int | None] = {}
        for at in ats:
            if at in (LATEST, EARLIEST):
                low, high = c.get_watermark_offsets(ck.TopicPartition(topic, 0), timeout=10)
                out[at] = int(high if at == LATEST else low)
            else:
                (got,) = c.offsets_for_times([ck.TopicPartition(topic, 0, at)], timeout=10)
                if got.error is not None:
                    raise RuntimeError(f"offsets_for_times({at}): {got.error}")
                out[at] = None if got.offset < 0 else int(got.offset)
        return out
    finally:
        c.close()


async def aiokafka(bootstrap: str, topic: str, ats: list[int]) -> dict[int, int | None]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    tp = TopicPartition(topic, 0)
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    await c.start()
    try:
        out: dict[int, int | None] = {}
        for at in ats:
            if at == LATEST:
                out[at] = (await c.end_offsets([tp]))[tp]
            elif at == EARLIEST:
                out[at] = (await c.beginning_offsets([tp]))[tp]
            else:
                got = (await c.offsets_for_times({tp: at}))[tp]
                out[at] = None if got is None else got.offset
        return out
    finally:
        await c.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("client", choices=["kafka-python", "confluent", "aiokafka"])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--at", type=int, action="append", default=[])
    args = ap.parse_args(argv)
    if args.client == "kafka-python":
        got = kafka_python(args.bootstrap, args.topic, args.at)
    elif args.client == "confluent":
        got = confluent(args.bootstrap, args.topic, args.at)
    else:
        got = asyncio.run(aiokafka(args.bootstrap, args.topic, args.at))
    print(json.dumps({"offsets": {str(k): v for k, v in got.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
