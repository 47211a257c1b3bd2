"""The etcd client cluster mode stands on: etcd's v3 JSON gateway over HTTP/1.1 on Trio.

Owns `Etcd` (range, txn, put/delete, lease grant/keep-alive/revoke, streamed watches),
the `Compare`/`Op` builders of transactions, and `EtcdError`. Keys and values are bytes
(the gateway wants them base64); revisions and lease ids are ints (the gateway sends
int64s as strings and leaves out fields at their zero value, as proto3 JSON does).

Why the gateway and our own HTTP client: etcd serves the same KV, lease and watch API as
JSON over HTTP (``/v3/...``) as it does over gRPC, so the broker needs no gRPC stack, no
generated stubs and no thread bridge: a short HTTP/1.1 client on trio streams suffices.
Unary calls use one connection each (``Connection: close``); a watch is one long
chunked response whose body is a stream of JSON objects, read as it arrives (no polling).

Only leases and transactions are used, never etcd's lock API (Jepsen found it unsafe).

Endpoints: a call tries each endpoint of ``hyperkafka.cluster.etcd.endpoints`` in turn,
starting with the last one that answered; each attempt is bounded by a cancel scope
(`REQUEST_TIMEOUT_S`). When none answers, `EtcdError` is raised: the caller decides.

May import trio only.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import trio

log = logging.getLogger("hyperkafka.etcd")

REQUEST_TIMEOUT_S = 5.0  # one unary call to one endpoint
CONNECT_TIMEOUT_S = 2.0
MAX_RESPONSE = 64 << 20  # a range of every placement record is far below this
MAX_HEADER = 64 << 10


class EtcdError(Exception):
    """etcd did not answer, or answered with an error (`code` is the gRPC status code when
    it said one: 5 NOT_FOUND for a lease that is gone, for example)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


LEASE_NOT_FOUND = 5  # gRPC NOT_FOUND: "etcdserver: requested lease not found"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The range end that makes `prefix` a prefix range (etcd's clientv3.GetPrefixRangeEnd)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def parse(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(
            _unb64(kv.get("key")),
            _unb64(kv.get("value")),
            int(kv.get("create_revision", 0)),
            int(kv.get("mod_revision", 0)),
            int(kv.get("version", 0)),
            int(kv.get("lease", 0)),
        )


@dataclass(frozen=True)
class Event:
    """One change seen by a watch: a put (`kv` is the new value) or a delete."""

    type: str  # "PUT" or "DELETE"
    kv: KeyValue


@dataclass(frozen=True)
class Compare:
    """One comparison of a transaction (etcd's Compare message)."""

    body: dict[str, Any]

    @classmethod
    def create_revision(cls, key: bytes, revision: int, result: str = "EQUAL") -> Compare:
        """The key's create revision (0: it does not exist)."""
        return cls(
            {
                "key": _b64(key),
                "target": "CREATE",
                "result": result,
                "create_revision": str(revision),
            }
        )

    @classmethod
    def mod_revision(cls, key: bytes, revision: int, result: str = "EQUAL") -> Compare:
        return cls(
            {"key": _b64(key), "target": "MOD", "result": result, "mod_revision": str(revision)}
        )

    @classmethod
    def value(cls, key: bytes, value: bytes, result: str = "EQUAL") -> Compare:
        return cls({"key": _b64(key), "target": "VALUE", "result": result, "value": _b64(value)})

    @classmethod
    def absent(cls, key: bytes) -> Compare:
        return cls.create_revision(key, 0)


@dataclass(frozen=True)
class Op:
    """One request of a transaction's branch (etcd's RequestOp)."""

    body: dict[str, Any]

    @classmethod
    def put(cls, key: bytes, value: bytes, lease: int = 0) -> Op:
        req: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            req["lease"] = str(lease)
        return cls({"request_put": req})

    @classmethod
    def delete(cls, key: bytes, *, prefix: bool = False) -> Op:
        req = {"key": _b64(key)}
        if prefix:
            req["range_end"] = _b64(prefix_end(key))
        return cls({"request_delete_range": req})

    @classmethod
    def get(cls, key: bytes, *, prefix: bool = False) -> Op:
        req = {"key": _b64(key)}
        if prefix:
            req["range_end"] = _b64(prefix_end(key))
        return cls({"request_range": req})


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    # the key-values of each request_range of the branch that ran, in order
    ranges: list[list[KeyValue]] = field(default_factory=list)


class _Http:
    """Just enough HTTP/1.1 for the gateway: POST a JSON body, read a JSON answer or a
    chunked stream of JSON objects."""

    def __init__(self, endpoint: str) -> None:
        url = urlsplit(endpoint)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"etcd endpoint {endpoint!r}: expected http://HOST:PORT")
        self.host = url.hostname
        self.port = url.port or 2379
        self.endpoint = endpoint

    async def _open(self, path: str, body: dict[str, Any]) -> tuple[trio.SocketStream, _Reader]:
        payload = json.dumps(body).encode()
        with trio.fail_after(CONNECT_TIMEOUT_S):
            stream = await trio.open_tcp_stream(self.host, self.port)
        try:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                "Connection: close\r\n\r\n"
            ).encode()
            await stream.send_all(head + payload)
            reader = _Reader(stream)
            await reader.read_head()
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return stream, reader

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        stream, reader = await self._open(path, body)
        try:
            data = await reader.read_body()
        finally:
            await trio.aclose_forcefully(stream)
        answer = _json(data)
        if reader.status != 200:
            raise EtcdError(
                f"etcd {path}: HTTP {reader.status}: {answer.get('message') or answer.get('error')}",
                _int_or_none(answer.get("code")),
            )
        return answer

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The JSON objects of a streamed answer, as they arrive."""
        stream, reader = await self._open(path, body)
        try:
            if reader.status != 200:
                answer = _json(await reader.read_body())
                raise EtcdError(
                    f"etcd {path}: HTTP {reader.status}: {answer.get('message') or answer.get('error')}",
                    _int_or_none(answer.get("code")),
                )
            decoder = json.JSONDecoder()
            buf = ""
            async for chunk in reader.chunks():
                buf += chunk.decode()
                while True:
                    buf = buf.lstrip()
                    if not buf:
                        break
                    try:
                        obj, end = decoder.raw_decode(buf)
                    except json.JSONDecodeError:
                        break  # the rest of this object is in a later chunk
                    buf = buf[end:]
                    if not isinstance(obj, dict):
                        raise EtcdError(f"etcd {path}: unexpected stream item {obj!r}")
                    yield obj
                if len(buf) > MAX_RESPONSE:
                    raise EtcdError(f"etcd {path}: a streamed object over {MAX_RESPONSE} bytes")
        finally:
            await trio.aclose_forcefully(stream)


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _json(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data) if data else {}
    except ValueError as e:
        raise EtcdError(f"etcd answered no JSON: {data[:200]!r}") from e
    if not isinstance(obj, dict):
        raise EtcdError(f"etcd answered {obj!r}")
    return obj


class _Reader:
    """Reads one HTTP/1.1 response from a stream, with a rolling buffer."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.eof = False

    async def _more(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            self.eof = True
            raise EtcdError("etcd closed the connection mid-answer")
        self.buf += data

    async def _line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > MAX_HEADER:
                raise EtcdError("etcd answered an over-long header line")
            await self._more()
        line = bytes(self.buf[:i])
        del self.buf[: i + 2]
        return line

    async def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._more()
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    async def read_head(self) -> None:
        status = (await self._line()).split(b" ", 2)
        if len(status) < 2 or not status[0].startswith(b"HTTP/1.") or not status[1].isdigit():
            raise EtcdError(f"etcd answered no HTTP: {status!r}")
        self.status = int(status[1])
        while line := await self._line():
            name, _, value = line.decode("latin-1").partition(":")
            self.headers[name.strip().lower()] = value.strip()

    async def chunks(self) -> AsyncIterator[bytes]:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_text = (await self._line()).split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError as e:
                    raise EtcdError(f"etcd answered a bad chunk size {size_text!r}") from e
                if size > MAX_RESPONSE:
                    raise EtcdError("etcd answered an over-long chunk")
                if size == 0:
                    return
                data = await self._exactly(size)
                await self._exactly(2)
                yield data
        elif "content-length" in self.headers:
            n = int(self.headers["content-length"])
            if n > MAX_RESPONSE:
                raise EtcdError("etcd answered an over-long body")
            yield await self._exactly(n)
        else:  # until the connection closes
            if self.buf:
                yield bytes(self.buf)
                self.buf.clear()
            while data := await self.stream.receive_some(65536):
                yield data

    async def read_body(self) -> bytes:
        out = bytearray()
        async for chunk in self.chunks():
            out += chunk
            if len(out) > MAX_RESPONSE:
                raise EtcdError("etcd answered an over-long body")
        return bytes(out)


class Etcd:
    """A client of one etcd cluster, reachable at any of `endpoints` (``http://HOST:PORT``)."""

    def __init__(self, endpoints: list[str]) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self._http = [_Http(e) for e in endpoints]
        self._good = 0  # the endpoint that answered last
        self.failovers = (
            0  # times a call moved to another endpoint (a watch may be stuck on the old one)
        )

    @property
    def endpoints(self) -> list[str]:
        return [h.endpoint for h in self._http]

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        last: Exception | None = None
        n = len(self._http)
        for k in range(n):
            i = (self._good + k) % n
            try:
                with trio.fail_after(REQUEST_TIMEOUT_S):
                    answer = await self._http[i].call(path, body)
            except EtcdError as e:
                if e.code is not None:  # etcd itself answered: no use asking another member
                    raise
                last = e
            except (OSError, trio.TooSlowError, trio.BrokenResourceError) as e:
                last = e
            else:
                if i != self._good:
                    self._good = i
                    self.failovers += 1
                return answer
        raise EtcdError(f"no etcd endpoint answered {path}: {last}")

    # -- key-value ---------------------------------------------------------------

    async def get(self, key: bytes, *, prefix: bool = False) -> tuple[list[KeyValue], int]:
        """The key (or every key under the prefix) and the store's revision."""
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(prefix_end(key))
        answer = await self._call("/v3/kv/range", body)
        return [KeyValue.parse(kv) for kv in answer.get("kvs", [])], int(
            answer["header"]["revision"]
        )

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        answer = await self._call("/v3/kv/put", body)
        return int(answer["header"]["revision"])

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(prefix_end(key))
        answer = await self._call("/v3/kv/deleterange", body)
        return int(answer.get("deleted", 0))

    async def txn(
        self, compare: list[Compare], success: list[Op], failure: list[Op] | None = None
    ) -> TxnResult:
        """If every comparison holds, run `success`, else `failure`: atomically (etcd's
        transactions are strict-serializable)."""
        body = {
            "compare": [c.body for c in compare],
            "success": [o.body for o in success],
            "failure": [o.body for o in failure or []],
        }
        answer = await self._call("/v3/kv/txn", body)
        ranges = [
            [KeyValue.parse(kv) for kv in r["response_range"].get("kvs", [])]
            for r in answer.get("responses", [])
            if "response_range" in r
        ]
        return TxnResult(
            bool(answer.get("succeeded", False)), int(answer["header"]["revision"]), ranges
        )

    # -- leases ------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; its id."""
        answer = await self._call("/v3/lease/grant", {"TTL": str(ttl_s)})
        if answer.get("error"):
            raise EtcdError(f"etcd lease grant: {answer['error']}")
        return int(answer["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew `lease` once; its new TTL in seconds, 0 when the lease is gone (expired or
        revoked: whatever was attached to it is deleted)."""
        answer = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        result = answer.get("result", answer)
        return int(result.get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as e:
            if e.code != LEASE_NOT_FOUND:
                raise

    # -- watches -----------------------------------------------------------------

    async def watch(
        self, key: bytes, *, prefix: bool = False, start_revision: int = 0
    ) -> AsyncIterator[list[Event]]:
        """The changes of the key (or prefix) from `start_revision` on (0: from now), in
        batches as etcd sends them, until the caller stops or the connection ends
        (`EtcdError`: the caller resumes from the last revision it saw plus one)."""
        create: dict[str, Any] = {"key": _b64(key), "progress_notify": True}
        if prefix:
            create["range_end"] = _b64(prefix_end(key))
        if start_revision:
            create["start_revision"] = str(start_revision)
        http = self._http[self._good]
        try:
            async for item in http.stream("/v3/watch", {"create_request": create}):
                result = item.get("result")
                if result is None:
                    if "error" in item:
                        raise EtcdError(f"etcd watch: {item['error']}")
                    continue
                if result.get("canceled"):
                    # compacted past our revision, or the server cancelled: start over
                    raise EtcdError(
                        f"etcd watch cancelled: {result.get('cancel_reason', '')}"
                        f" (compact_revision {result.get('compact_revision', 0)})"
                    )
                events = [
                    Event(e.get("type", "PUT"), KeyValue.parse(e.get("kv", {})))
                    for e in result.get("events", [])
                ]
                if events:
                    yield events
        except (OSError, trio.BrokenResourceError) as e:
            self._good = (self._good + 1) % len(self._http)
            raise EtcdError(f"etcd watch ended: {e}") from e
        except EtcdError:
            self._good = (self._good + 1) % len(self._http)
            raise
