"""The test's own network: one namespace per host, a bridge in a namespace of its own.

Owns `Network`: it creates network namespaces named ``hkj-<random>-<host>`` and
``hkj-<random>-br``, joins each host to the bridge by a veth pair created directly inside
the two namespaces (so nothing is ever added to, or changed in, the root namespace), gives
each host an address of a private range that exists only inside these namespaces, and cuts
and heals links with nftables rules inside the hosts' namespaces: a cut drops packets
silently (no RST, no ICMP), as a real partition does, so peers only learn of it by timeouts.

Clean-up deletes exactly the namespaces it created, by name (deleting a namespace deletes
the veth ends and rules inside it). It runs on `close`, at interpreter exit, and on
SIGTERM/SIGINT: a Ctrl-C during a test still leaves nothing behind.

May import only the standard library.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")

SUBNET = "10.213.{}.{}"  # a private range; only ever configured inside our namespaces
NFT_TABLE = "hkj_nemesis"


def missing_tools() -> str | None:
    """Why this machine cannot build the network, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y iproute2 nftables)"
    return None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


class Network:
    """Hosts (by name) on one bridge, each in its own namespace, with addresses 10.213.x.y."""

    def __init__(self, hosts: Iterable[str]) -> None:
        self.tag = f"hkj-{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts = list(hosts)
        self.namespaces: list[str] = []  # created so far: what `close` deletes
        self.address: dict[str, str] = {}
        self.cut: set[frozenset[str]] = set()
        octet = secrets.randbelow(200) + 20
        atexit.register(self.close)
        try:
            self._add_ns(self.bridge_ns)
            self._ip(self.bridge_ns, "link", "add", "br0", "type", "bridge")
            self._ip(self.bridge_ns, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts, start=1):
                ns = self.ns(host)
                self._add_ns(ns)
                # Both ends are created straight inside their namespaces: the root
                # namespace never sees them.
                _run(
                    [
                        "ip",
                        "link",
                        "add",
                        "eth0",
                        "netns",
                        ns,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        f"p{i}",
                        "netns",
                        self.bridge_ns,
                    ]
                )
                self._ip(self.bridge_ns, "link", "set", f"p{i}", "master", "br0", "up")
                addr = SUBNET.format(octet, i)
                self.address[host] = addr
                self._ip(ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                self._ip(ns, "link", "set", "eth0", "up")
                self._ip(ns, "link", "set", "lo", "up")
                _run(["ip", "netns", "exec", ns, "nft", "add", "table", "inet", NFT_TABLE])
                for hook in ("input", "output"):
                    _run(
                        [
                            "ip",
                            "netns",
                            "exec",
                            ns,
                            "nft",
                            "add",
                            "chain",
                            "inet",
                            NFT_TABLE,
                            hook,
                            f"{{ type filter hook {hook} priority 0 ; policy accept ; }}",
                        ]
                    )
        except BaseException:
            self.close()
            raise

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.namespaces.append(name)

    @staticmethod
    def _ip(ns: str, *args: str) -> None:
        _run(["ip", "-n", ns, *args])

    # --- faults ---------------------------------------------------------------------------

    def partition(self, *sides: Iterable[str]) -> None:
        """Cut every link between hosts of different sides (hosts on no side keep all
        their links: the clients' host talks to everyone, as Jepsen's control node)."""
        groups = [set(s) for s in sides]
        for a_i, a in enumerate(groups):
            for b in groups[a_i + 1 :]:
                for x in a:
                    for y in b:
                        self._drop(x, y)

    def _drop(self, x: str, y: str) -> None:
        pair = frozenset((x, y))
        if pair in self.cut:
            return
        self.cut.add(pair)
        for me, other in ((x, y), (y, x)):
            ns, addr = self.ns(me), self.address[other]
            _run(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "nft",
                    "add",
                    "rule",
                    "inet",
                    NFT_TABLE,
                    "input",
                    "ip",
                    "saddr",
                    addr,
                    "drop",
                ]
            )
            _run(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "nft",
                    "add",
                    "rule",
                    "inet",
                    NFT_TABLE,
                    "output",
                    "ip",
                    "daddr",
                    addr,
                    "drop",
                ]
            )

    def heal(self) -> None:
        for host in self.hosts:
            for hook in ("input", "output"):
                _run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        self.ns(host),
                        "nft",
                        "flush",
                        "chain",
                        "inet",
                        NFT_TABLE,
                        hook,
                    ]
                )
        self.cut.clear()

    # --- clean-up -------------------------------------------------------------------------

    def close(self) -> None:
        """Delete every namespace this network made, by its exact name (idempotent)."""
        while self.namespaces:
            name = self.namespaces.pop()
            _run(["ip", "netns", "delete", name], check=False)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)


def leftovers(tag: str) -> list[str]:
    """Namespaces named after `tag` that still exist (a test asserts there are none)."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag + "-")]


_CLONE_NEWNET = 0x40000000


def in_namespace(ns: str, fn: Callable[[], T]) -> T:
    """`fn()` run in a new thread that first joins namespace `ns` (setns(2) moves only the
    calling thread), so the test process itself can talk to hosts without a subprocess.
    Sockets made there stay in that namespace whatever thread uses them later."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({ns})")
            finally:
                os.close(fd)
            result.append(fn())
        except BaseException as e:
            error.append(e)

    t = threading.Thread(target=run, name=f"in-{ns}")
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]
