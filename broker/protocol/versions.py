"""The API version ranges this codec is tested for, as kafka-wire.md §6 recommends.

`RECOMMENDED_RANGES` is a ceiling, not the advertisement: ApiVersions must list only
what handlers implement, so a server should advertise the intersection of this table
with its handler registry (`intersect_ranges`). Produce starts at 0 because librdkafka
<= 2.11.0 enables compression only when it sees Produce v0 advertised (Kafka 4.0 does the
same and rejects 0-2 at request time: the server should close the connection for them).
Everything stops below the topic-id versions (Produce/Fetch <= 12, OffsetCommit/
OffsetFetch <= 9). Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = ["API_NAMES", "RECOMMENDED_RANGES", "intersect_ranges"]

RECOMMENDED_RANGES: Final[Mapping[int, tuple[int, int]]] = {
    0: (0, 11),  # Produce (3-11 decodable via the fast path; 0-2 advertised, then refused)
    1: (4, 12),  # Fetch
    2: (1, 7),  # ListOffsets
    3: (0, 12),  # Metadata
    8: (2, 9),  # OffsetCommit
    9: (1, 9),  # OffsetFetch
    10: (0, 6),  # FindCoordinator
    11: (0, 9),  # JoinGroup
    12: (0, 4),  # Heartbeat
    13: (0, 5),  # LeaveGroup
    14: (0, 5),  # SyncGroup
    15: (0, 5),  # DescribeGroups
    16: (0, 5),  # ListGroups
    18: (0, 4),  # ApiVersions
    19: (2, 7),  # CreateTopics
    20: (1, 6),  # DeleteTopics
    22: (0, 5),  # InitProducerId
    23: (2, 4),  # OffsetForLeaderEpoch
    32: (1, 4),  # DescribeConfigs
    42: (0, 2),  # DeleteGroups
    47: (0, 0),  # OffsetDelete
    60: (0, 1),  # DescribeCluster
}

API_NAMES: Final[Mapping[int, str]] = {
    0: "Produce", 1: "Fetch", 2: "ListOffsets", 3: "Metadata", 8: "OffsetCommit",
    9: "OffsetFetch", 10: "FindCoordinator", 11: "JoinGroup", 12: "Heartbeat",
    13: "LeaveGroup", 14: "SyncGroup", 15: "DescribeGroups", 16: "ListGroups",
    18: "ApiVersions", 19: "CreateTopics", 20: "DeleteTopics", 22: "InitProducerId",
    23: "OffsetForLeaderEpoch", 32: "DescribeConfigs", 42: "DeleteGroups",
    47: "OffsetDelete", 60: "DescribeCluster",
}  # fmt: skip


def intersect_ranges(
    a: Mapping[int, tuple[int, int]], b: Mapping[int, tuple[int, int]]
) -> dict[int, tuple[int, int]]:
    """Per api key, the overlap of two range tables; keys with no overlap are dropped."""
    out: dict[int, tuple[int, int]] = {}
    for key in a.keys() & b.keys():
        lo = max(a[key][0], b[key][0])
        hi = min(a[key][1], b[key][1])
        if lo <= hi:
            out[key] = (lo, hi)
    return dict(sorted(out.items()))
