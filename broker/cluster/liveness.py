"""Cluster mode: evidence of a peer's death, so that a killed broker is failed over at
once instead of a session timeout later (docs/clusters.md "Death evidence").

Owns `watch_peers`: this broker holds one idle TCP connection to each live peer's Kafka
listener (the address of its registration) for as long as that peer keeps the session
it registered on (the lease of ``brokers/<id>``, `Membership.sessions`). When the
connection ends, it connects again at once. Refused (nothing listens there any more),
after that very session had been reached, is evidence that the peer's process is gone:
killed, crashed, out of memory. The kernel of a live host resets every socket of a dead
process, so this is known within milliseconds, where the lease takes up to the session
timeout (`broker.session.timeout.ms`) to expire. The watcher then revokes that lease:
the peer's expiry brought forward. Its registration goes, every broker's view loses it
at once, and the cluster does what the expiry would have made it do: the controller
holds the vote for the quorum-signed partitions it led, and the coordinators of its
groups and transactions move.

Why it is safe. Revoking a lease is its expiry, early. Every exclusive act of a broker
is an etcd transaction fenced by its lease or by a revision its lease guarded, and a
quorum-signed partition is fenced by the vote's promises, not by the lease; a broker
wrongly thought dead is only moved, as after a pause: it learns at its next keep-alive
that its lease is gone and registers again on a new one. And the evidence is strong:
only ECONNREFUSED on the very address that answered in this session counts (a
connection the peer itself closed, a timeout, an unreachable host do not; an address
that never answered, as a registration advertising a name peers cannot reach, proves
nothing). A restarted broker registers on a new lease before it listens: the session
watched is the old one, whose revocation takes nothing from the new registration.

What it cannot see: a paused process (its kernel still holds its sockets open), a host
that died with the process, or a network cut. Those are silence, and silence waits for
the lease.

Transport only (`open_peer_stream`: a TCP connection that is never to itself); may import
trio and `broker.cluster.membership`.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable

import trio

from broker.cluster.etcd import EtcdError
from broker.cluster.membership import Member, Membership

log = logging.getLogger("hyperkafka.cluster")

CONNECT_TIMEOUT_S = 5.0
RETRY_MIN_S = 0.2  # after a failure that is no evidence (timeout, unreachable)
RETRY_MAX_S = 5.0
RECEIVE_BYTES = 4096
HELD_MIN_S = 1.0  # a connection closed sooner is retried with backoff, not at once


async def open_peer_stream(host: str, port: int) -> trio.SocketStream:
    """A TCP connection to a peer, never one to itself: probing a dead peer's port on this
    host, the kernel may pick that very port as the source port, and TCP then connects
    the socket to itself (a request would come back as the answer, a Noise handshake
    would meet itself). Refused, as the dead port would have been."""
    stream = await trio.open_tcp_stream(host, port)
    sock = stream.socket
    try:
        looped = sock.getsockname() == sock.getpeername()
    except OSError:
        looped = False
    if looped:
        await trio.aclose_forcefully(stream)
        raise ConnectionRefusedError(
            errno.ECONNREFUSED, f"{host}:{port} is not listening (the connection reached itself)"
        )
    return stream


def refused(exc: BaseException) -> bool:
    """Whether connecting failed only because nothing listens there (ECONNREFUSED).
    trio's `open_tcp_stream` raises a plain OSError when every address failed, caused
    by a group of each attempt's error: refused only if every attempt was."""
    if isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED:
        return True
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        return all(refused(e) for e in cause.exceptions)
    return cause is not None and refused(cause)


Connect = Callable[[str, int], Awaitable[trio.SocketStream]]


async def watch_peers(membership: Membership, connect: Connect = open_peer_stream) -> None:
    """Watch every live peer's session for evidence of its death (above), until
    cancelled: one task per (broker, session), started as the view shows it and ending
    with it."""
    watched: dict[tuple[int, int], trio.CancelScope] = {}

    async def watch(member: Member, lease: int, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            try:
                if await _wait_for_death(member, connect):
                    await _revoke(membership, member, lease)
            except Exception:  # a watcher's failure must not end the broker: the lease stays
                log.exception("cluster: watching broker %d failed", member.node_id)
        # its key stays in `watched` until the view drops that session: not watched twice

    async with trio.open_nursery() as nursery:
        while True:
            changed = membership.changed
            live = {
                (node_id, lease): membership.members[node_id]
                for node_id, lease in list(membership.sessions.items())
                if node_id != membership.me.node_id and lease and node_id in membership.members
            }
            for key, scope in list(watched.items()):
                if key not in live:
                    scope.cancel()
                    del watched[key]
            for key, member in live.items():
                if key not in watched:
                    watched[key] = await nursery.start(watch, member, key[1])
            await changed.wait()


async def _wait_for_death(member: Member, connect: Connect) -> bool:
    """Hold a connection to `member`'s address, again each time it ends; True once it is
    refused after one was made (evidence of death). Runs until then, or until cancelled
    (the session ended: the view moved on)."""
    reached = False
    backoff = RETRY_MIN_S
    while True:
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                stream = await connect(member.host, member.port)
        except OSError as exc:
            if reached and refused(exc):
                return True
            # unreachable, or not listening yet (a restarted broker registers first)
        except trio.TooSlowError:
            pass  # silence: no evidence
        else:
            reached = True
            opened = trio.current_time()
            async with stream:
                try:
                    while await stream.receive_some(RECEIVE_BYTES):
                        pass  # nothing is sent on it; whatever comes is ignored
                except (trio.BrokenResourceError, OSError):
                    pass  # reset
            # Closed: by the peer's idle reaper, or by its death. Look again at once,
            # unless it closes as soon as it opens (a connection limit): then back off.
            if trio.current_time() - opened >= HELD_MIN_S:
                backoff = RETRY_MIN_S
                continue
        await trio.sleep(backoff)
        backoff = min(backoff * 2, RETRY_MAX_S)


async def _revoke(membership: Membership, member: Member, lease: int) -> None:
    if membership.sessions.get(member.node_id) != lease:
        return  # the session already ended (expired, or replaced by a restart)
    log.warning(
        "cluster: broker %d at %s refuses connections: its process is gone; revoking "
        "its session (lease %x) now instead of waiting for it to expire",
        member.node_id,
        member.address,
        lease,
    )
    try:
        await membership.etcd.revoke(lease)
    except EtcdError as exc:  # the lease will expire by itself: nothing is lost
        log.info("cluster: revoking broker %d's lease %x failed: %s", member.node_id, lease, exc)
