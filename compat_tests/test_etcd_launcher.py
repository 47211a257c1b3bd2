"""compat_tests/etcd.py's launcher: one etcd member alone, or several forming one cluster
(the shape compat_tests/jepsen runs inside network namespaces), here on loopback ports."""

from __future__ import annotations

import json
import urllib.request
from base64 import b64encode
from pathlib import Path

from compat_tests.etcd import EtcdServer, running_etcd


def _call(endpoint: str, path: str, body: dict[str, str]) -> dict[str, object]:
    req = urllib.request.Request(f"{endpoint}{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        out: dict[str, object] = json.load(resp)
        return out


def _b64(text: str) -> str:
    return b64encode(text.encode()).decode()


def test_members_form_one_cluster(tmp_path: Path) -> None:
    with running_etcd(tmp_path / "probe"):  # skips (fails under CI) without etcd
        pass
    names = ["m1", "m2", "m3"]
    servers = [EtcdServer(tmp_path / n, name=n) for n in names]
    members = {s.name: s.peer_url for s in servers}
    servers = [
        EtcdServer(
            tmp_path / s.name,
            name=s.name,
            client_port=s.client_port,
            peer_port=s.peer_port,
            members=members,
            token="launcher-test",
        )
        for s in servers
    ]
    assert f"m1={members['m1']},m2={members['m2']},m3={members['m3']}" in servers[0].command()
    try:
        for s in servers:
            s.spawn()
        for s in servers:
            s.wait_ready()
        _call(servers[0].endpoint, "/v3/kv/put", {"key": _b64("k"), "value": _b64("v")})
        got = _call(servers[2].endpoint, "/v3/kv/range", {"key": _b64("k")})
        assert got["kvs"][0]["value"] == _b64("v")  # type: ignore[index]
        status = _call(servers[1].endpoint, "/v3/cluster/member/list", {})
        assert sorted(m["name"] for m in status["members"]) == names  # type: ignore[attr-defined,union-attr]
    finally:
        for s in servers:
            s.stop()
