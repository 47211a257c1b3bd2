"""The broker's memory budget for requests: Kafka's `queued.max.request.bytes`.

Owns `RequestPool` (the bytes of requests received and not yet handled, all connections
together) and `ConnectionBudget` (one connection's share of it, and the answers it has
not read yet). Imports trio only; the server (broker/server.py) drives both.

Theory of operation. A connection takes bytes from the pool *before* it reads them from
its socket (`ConnectionBudget.grant`), at most what the pool has left, so the pool is a
hard bound on what requests hold; when the pool is empty the connection stops reading,
and the kernel's window then stops its client (Kafka mutes the channel the same way).
Bytes are charged as they arrive, not when a size prefix announces them: a peer that
sends a size prefix and nothing else holds four bytes, not the frame it announced, and
cannot starve the pool for clients that do send. Once a frame is whole its bytes become
a `Ticket`, returned to the pool when the request's handling is done: at once for an
answer computed by its handler; for a Produce, whose record batches are views into the
frame until the commit round wrote them, when its answer is ready (the round ran).

Never a deadlock: frames half received could in principle hold the whole pool while
each waits for more. One of them at a time may take the *lane* and finish its frame
beyond the pool (Kafka's non-strict `SimpleMemoryPool` likewise lets one allocation go
past the bound), so the pool holds at most its size plus one frame, and a frame larger
than the whole pool is still served. A lane holder that stops sending is closed by the
request timeout like any request that trickles in.

A connection's unsent answers are bounded too (`hyperkafka.connection.max.unsent.bytes`):
past the bound the server reads nothing more from it until its client reads. And what a
handler reads into memory for an answer (Fetch data below the sendfile size, or any over
TLS) comes from a second pool of the same size (`AnswerMemory`) until the answer is
sent: with it spent, Fetch answers what it already has, except that the first
partition's batch always comes (Kafka's KIP-74 rule), and the rest comes next time. A
pool of its own, so that clients leaving answers unread cannot stop requests from being
read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["AnswerMemory", "ConnectionBudget", "RequestPool", "Ticket"]


class RequestPool:
    """Bytes of requests in the broker, at most `capacity` (plus one frame on the lane).

    capacity <= 0: unbounded (Kafka's -1); every grant is what was asked.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.bounded = capacity > 0
        self.available = capacity
        self.lane: object | None = None  # the connection finishing a frame past the bound
        self._changed = trio.Event()

    def take_up_to(self, n: int) -> int:
        """Take at most `n` bytes; how many (0 when the pool is empty)."""
        if not self.bounded:
            return n
        got = min(n, self.available)
        if got <= 0:
            return 0
        self.available -= got
        return got

    def force(self, n: int) -> None:
        """Charge `n` bytes already received (a TLS read), even past the bound."""
        if self.bounded:
            self.available -= n

    def give(self, n: int) -> None:
        if not self.bounded or n <= 0:
            return
        self.available += n
        self._wake()

    def try_lane(self, owner: object) -> bool:
        if self.lane is None:
            self.lane = owner
        return self.lane is owner

    def leave_lane(self, owner: object) -> None:
        if self.lane is owner:
            self.lane = None
            self._wake()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def statistics(self) -> dict[str, int]:
        return {
            "capacity": self.capacity,
            "available": self.available,
            "in_use": self.capacity - self.available,
        }


class AnswerMemory:
    """Bytes one handler read into memory for its answer, taken from the pool."""

    __slots__ = ("held", "pool")

    def __init__(self, pool: RequestPool) -> None:
        self.pool = pool
        self.held = 0

    def take(self, n: int, *, anyway: bool = False) -> bool:
        """Take `n` bytes if the pool has them (or `anyway`, past the bound); whether taken."""
        pool = self.pool
        if not pool.bounded:
            return True
        if pool.available < n and not anyway:
            return False
        pool.available -= n
        self.held += n
        return True

    def give_back(self) -> None:
        held, self.held = self.held, 0
        self.pool.give(held)


class Ticket:
    """Bytes of one request frame (or one answer's data) held in a pool, given back once
    (`release`)."""

    __slots__ = ("budget", "pool", "size")

    def __init__(
        self, budget: ConnectionBudget, size: int, pool: RequestPool | None = None
    ) -> None:
        self.budget: ConnectionBudget | None = budget
        self.pool = pool if pool is not None else budget.pool
        self.size = size

    def release(self) -> None:
        budget, self.budget = self.budget, None
        if budget is not None:
            budget.tickets.discard(self)
            self.pool.give(self.size)


class ConnectionBudget:
    """One connection's bytes in the pool, and the answers it has not read yet."""

    def __init__(self, pool: RequestPool, max_unsent: int) -> None:
        self.pool = pool
        self.max_unsent = max_unsent
        self.unframed = 0  # received and charged, not yet part of a whole frame
        self.tickets: set[Ticket] = set()
        # Produce answers waiting for their commit round, oldest first, with their frame's
        # ticket: given back as soon as the round has written the batches.
        self.waiting: deque[tuple[Ticket, Callable[[], bool]]] = deque()
        self.unsent = 0  # bytes of answers queued or being written, not yet sent
        self._sent = trio.Event()

    # Request bytes.

    async def grant(self, want: int, needed: int | None, mid_frame: bool) -> int:
        """Bytes this connection may read now (<= want), taken from the pool; waits
        (reading nothing: back-pressure) while the pool is empty. `needed` is what the
        frame being received still lacks, when known: the lane covers only that."""
        pool = self.pool
        while True:
            got = pool.take_up_to(want)
            if got:
                return got
            self.release_ready()
            if mid_frame and pool.try_lane(self):
                got = min(want, needed) if needed else want
                pool.force(got)
                return got
            await pool.wait_changed()

    async def wait_room(self, mid_frame: bool) -> None:
        """Before a read whose size cannot be chosen (TLS): wait while the pool is spent."""
        pool = self.pool
        while pool.bounded and pool.available <= 0:
            self.release_ready()
            if mid_frame and pool.try_lane(self):
                return
            await pool.wait_changed()

    def received(self, granted: int, got: int) -> None:
        """`got` of the `granted` bytes arrived; the rest goes back."""
        self.unframed += got
        if granted > got:
            self.pool.give(granted - got)

    def hold(self, memory: AnswerMemory) -> Ticket | None:
        """What `memory` took, as a ticket of this connection (given back once sent)."""
        if not memory.held:
            return None
        ticket = Ticket(self, memory.held, memory.pool)
        memory.held = 0
        self.tickets.add(ticket)
        return ticket

    def frame_done(self, size: int) -> Ticket | None:
        """A whole frame of `size` bytes (prefix included) left the decoder: its ticket."""
        self.pool.leave_lane(self)
        if not self.pool.bounded:
            return None
        self.unframed -= size
        ticket = Ticket(self, size)
        self.tickets.add(ticket)
        return ticket

    def wait_for(self, ticket: Ticket | None, ready: Callable[[], bool]) -> None:
        """Keep `ticket` until `ready()` (a Produce's commit round has run)."""
        if ticket is not None:
            self.waiting.append((ticket, ready))

    def release_ready(self) -> None:
        waiting = self.waiting
        while waiting:
            ticket, ready = waiting[0]
            if ticket.budget is not None and not ready():
                return
            waiting.popleft()
            ticket.release()

    def close(self) -> None:
        """The connection is gone: everything it held goes back."""
        self.pool.leave_lane(self)
        for ticket in list(self.tickets):
            ticket.release()
        self.waiting.clear()
        self.pool.give(self.unframed)
        self.unframed = 0

    # Answers.

    def queued(self, n: int) -> None:
        self.unsent += n

    def sent(self, n: int) -> None:
        self.unsent -= n
        self._sent.set()
        self._sent = trio.Event()

    @property
    def over(self) -> bool:
        return self.unsent > self.max_unsent

    async def wait_sent(self) -> None:
        """Until the writer sent something (or a Produce round freed request bytes)."""
        with trio.move_on_after(0.05):  # meanwhile give back what committed rounds freed
            await self._sent.wait()
        self.release_ready()


def memory_of(parts: list[Any] | None) -> int:
    """Bytes an answer's pieces hold in memory (file ranges for sendfile hold none)."""
    if not parts:
        return 0
    return sum(len(p) for p in parts if isinstance(p, bytes | bytearray | memoryview))
