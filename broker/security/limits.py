"""Limits that keep one client from starving the others: connections and byte rates.

Owns `ConnectionLimiter` (open connections in total and per client IP, with per-IP
overrides, as Kafka's max.connections / max.connections.per.ip) and `ByteRateQuota`
(bytes per second per principal, reporting the throttle time Kafka's quota manager
would: KIP-219, the broker answers at once with throttle_time_ms and then mutes the
connection for that long). Sans-I/O: callers pass the clock. Imports only the standard
library.
"""

from __future__ import annotations

from collections.abc import Mapping


class ConnectionLimiter:
    def __init__(self, total: int, per_ip: int, overrides: Mapping[str, int] | None = None) -> None:
        self.total = total
        self.per_ip = per_ip
        self.overrides = dict(overrides or {})
        self.open = 0
        self.by_ip: dict[str, int] = {}

    def acquire(self, ip: str) -> str | None:
        """Count a new connection; a reason string (and no count) when it must be refused."""
        if self.open >= self.total:
            return f"{self.open} connections open (max.connections={self.total})"
        limit = self.overrides.get(ip, self.per_ip)
        have = self.by_ip.get(ip, 0)
        if have >= limit:
            return f"{have} connections open from {ip} (max.connections.per.ip={limit})"
        self.open += 1
        self.by_ip[ip] = have + 1
        return None

    def release(self, ip: str) -> None:
        self.open -= 1
        left = self.by_ip.get(ip, 1) - 1
        if left > 0:
            self.by_ip[ip] = left
        else:
            self.by_ip.pop(ip, None)


class ByteRateQuota:
    """Per-principal byte rate as a virtual clock (GCRA).

    Each principal has a theoretical time `tat` at which its traffic so far would have
    been sent at exactly the allowed rate. A request of n bytes moves it n/rate seconds;
    a burst of up to `window_s` seconds' worth is free (Kafka measures over a window of
    samples too), and anything beyond is answered with that excess as throttle time.
    """

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._tat: dict[str, float] = {}

    def record(self, principal: str, nbytes: int, rate: float, now: float) -> float:
        """Account nbytes; return the throttle time in seconds (0.0 when within quota)."""
        tat = max(self._tat.get(principal, now), now) + nbytes / rate
        self._tat[principal] = tat
        return max(0.0, tat - now - self.window_s)

    def excess(self, principal: str, now: float) -> float:
        """Seconds this principal is over its quota already, before any new bytes."""
        return max(0.0, self._tat.get(principal, now) - now - self.window_s)

    def forget_idle(self, now: float) -> None:
        """Drop principals whose clocks are in the past: they hold no debt."""
        for p in [p for p, t in self._tat.items() if t < now]:
            del self._tat[p]


def raise_nofile_limit() -> int:
    """Lift the soft open-file limit to the hard one, so max.connections, not the OS, decides."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft
