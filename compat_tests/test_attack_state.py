"""Attack suite: state that one hostile client leaves behind for everyone else.

A client joins a group with a 32,767-byte client id (the most a request header holds;
the member id Kafka derives from it would not fit in an answer) at JoinGroup v0, v3 and
v5, with a 32,767-byte group instance id, and with a member id of its own choosing; right
after each, DescribeGroups must answer about the group, and afterwards a normal member must
join it and ListGroups must answer, every time within 30 s. The refusal may be an error or a closed connection for the attacker; for the
normal member only an answer will do. Runs beside the good producer (compat_tests.attack.guard).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from broker.protocol.codec import decode_response, encode_request, request_schema
from broker.protocol.header import RequestHeader
from compat_tests.attack import wire
from compat_tests.attack.guard import Bounds, Guard
from compat_tests.attack.schema import make

GROUP = "poisoned"
HUGE = "c" * 32767


def _join(g: Guard, client_id: str, member_id: str = "", instance: str | None = None,
          version: int = 5) -> tuple[str, Any]:  # fmt: skip
    """One JoinGroup on a new connection: ("answered", response) or ("closed"/"hung", None)."""
    req = make(request_schema(11, version), {
        "group_id": GROUP, "session_timeout": wire.ms(6000), "rebalance_timeout": wire.ms(2000),
        "member_id": member_id, "group_instance_id": instance, "protocol_type": "consumer",
        "protocols": [{"name": "range", "metadata": b"\x00\x01"}],
    })  # fmt: skip
    try:
        with wire.Conn(g.host, g.port, 30) as c:
            c.send(encode_request(RequestHeader(11, version, 1, client_id), req))
            _cid, resp = decode_response(c.recv_frame(30), 11, version)
            return "answered", resp
    except wire.Closed:
        return "closed", None
    except TimeoutError:
        return "hung", None


@pytest.mark.timeout(240)
@pytest.mark.matrix("attack-poisoned-group", client="raw-socket")
def test_poisoned_group(tmp_path: Path, record_property: Callable[[str, Any], None]) -> None:
    with Guard(tmp_path, "poisoned-group", Bounds(), record=record_property) as g:
        problems: list[str] = []
        attacks: dict[str, str] = {}
        for label, kwargs in (
            ("client id of 32767 bytes, v3", {"client_id": HUGE, "version": 3}),
            ("client id of 32767 bytes, v0", {"client_id": HUGE, "version": 0}),
            ("client id of 32767 bytes, v5", {"client_id": HUGE}),
            ("instance id of 32767 bytes", {"client_id": "x", "instance": HUGE}),
            ("member id of 32767 bytes", {"client_id": "x", "member_id": HUGE}),
        ):
            outcome, resp = _join(g, **kwargs)
            if resp is not None and int(resp.error_code.value) == 79:  # MEMBER_ID_REQUIRED
                outcome, resp = _join(g, member_id=str(resp.member_id), **kwargs)
            attacks[label] = outcome if resp is None else f"error {int(resp.error_code.value)}"
            g.check(f"JoinGroup with a {label}")
            # Right away, while whatever it left is in the group: the group must be described.
            try:
                wire.call(g.host, g.port, 15, 5, {"groups": [GROUP],
                                                  "include_authorized_operations": False})  # fmt: skip
            except Exception as exc:
                problems.append(f"DescribeGroups right after a JoinGroup with a {label}: {exc!r}")
        record_property("attacker_joins", attacks)
        outcome, resp = _join(g, "good-member")
        if resp is not None and int(resp.error_code.value) == 79:
            outcome, resp = _join(g, "good-member", member_id=str(resp.member_id))
        if resp is None:
            problems.append(f"a normal member's JoinGroup after the attack: {outcome}")
        elif int(resp.error_code.value) != 0:
            problems.append(
                f"a normal member's JoinGroup after the attack: error {resp.error_code}"
            )
        for key, version, values in (
            (15, 5, {"groups": [GROUP], "include_authorized_operations": False}),
            (16, 4, {"states_filter": []}),
        ):
            try:
                wire.call(g.host, g.port, key, version, values)
            except Exception as exc:
                problems.append(f"api {key} v{version} about the group after the attack: {exc!r}")
        g.end_attack()
        g.finish(problems)
