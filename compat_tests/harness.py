"""Broker processes, ports and external-client discovery for the compatibility tests.

Owns: starting and stopping the broker under test (our own `python -m broker serve`, or a
command template for a stand-in broker), telling when it answers, its log tail, and finding
the external clients (two kcats, node + kafkajs, the Go driver hkgo). It may import only the standard library
and compat_tests.broker_logs: it must work before anything else in the project does.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from compat_tests import broker_logs
from compat_tests.ports import (
    free_port as free_port,  # re-exported: the tests call harness.free_port
)

ROOT = Path(__file__).resolve().parent.parent
COMPAT_DIR = ROOT / "compat_tests"
TOOLS_DIR = COMPAT_DIR / ".tools"
JS_DIR = COMPAT_DIR / "js"
GO_DIR = COMPAT_DIR / "go"
HKGO = TOOLS_DIR / "hkgo"

IN_CI = os.environ.get("CI", "").lower() == "true"


class BrokerError(Exception):
    """The broker under test did not start, did not answer, or did not stop cleanly."""




def hyperkafka(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`hyperkafka <args>` (``python -m broker``) of this checkout, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "broker", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
    )


def verified(data_dir: Path | None, *args: str) -> str:
    """`hyperkafka verify --data-dir <data_dir> [args]`, which must pass: its output."""
    assert data_dir is not None
    r = hyperkafka("verify", "--data-dir", str(data_dir), *args)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout + r.stderr


def api_versions_v0_probe(host: str, port: int, timeout: float = 2.0) -> bool:
    """True when a Kafka broker answers an ApiVersions v0 request on host:port.

    v0 is the one version every broker must answer with a v0 body (KIP-511), so this is the
    cheapest way to tell "process listening" from "broker serving requests".
    """
    correlation_id = 0x48_4B_01
    client_id = b"hk-probe"
    body = struct.pack(">hhih", 18, 0, correlation_id, len(client_id)) + client_id
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(struct.pack(">i", len(body)) + body)
            head = recv_exact(s, 8)
    except OSError:
        return False
    if head is None:
        return False
    _size, got = struct.unpack(">ii", head)
    return bool(got == correlation_id)


def recv_exact(s: socket.socket, n: int) -> bytes | None:
    """Read exactly n bytes, or None when the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


@dataclass
class Broker:
    """A broker the tests talk to. `proc` is None for an external one (HK_COMPAT_BOOTSTRAP)."""

    host: str
    port: int
    data_dir: Path | None = None
    argv: list[str] = field(default_factory=list)
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def external(self) -> bool:
        return not self.argv

    def log_tail(self, lines: int = 80) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(external broker: no log)"
        text = self.log_path.read_bytes().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        if self.proc is None:
            return api_versions_v0_probe(self.host, self.port)
        return self.proc.poll() is None

    def start(self, timeout: float = 30.0) -> None:
        """Start the process and wait until it answers ApiVersions; BrokerError otherwise."""
        if self.external:
            wait_until_answers(self, timeout)
            return
        assert self.log_path is not None
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a ^C in the terminal must not reach it first
            )
        finally:
            log.close()
        wait_until_answers(self, timeout)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait, return the exit status (SIGKILL and BrokerError if it hangs)."""
        if self.proc is None:
            return 0
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise BrokerError(
                f"broker pid {proc.pid} ignored SIGTERM for {timeout}s; killed.\n" + self.log_tail()
            ) from None

    def kill(self) -> None:
        """Last-resort cleanup used by fixtures after a failure."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def wait_until_answers(broker: Broker, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if broker.proc is not None and broker.proc.poll() is not None:
            raise BrokerError(
                f"broker exited with status {broker.proc.returncode} before answering.\n"
                f"argv: {broker.argv}\n" + broker.log_tail()
            )
        if api_versions_v0_probe(broker.host, broker.port, timeout=1.0):
            return
        time.sleep(0.1)
    raise BrokerError(
        f"broker at {broker.bootstrap} did not answer ApiVersions within {timeout}s.\n"
        + broker.log_tail()
    )


def parse_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def broker_argv(data_dir: Path, port: int) -> list[str]:
    """The command that starts a broker on 127.0.0.1:port with its data in data_dir.

    By default our own broker. HK_COMPAT_BROKER_CMD replaces it with a template (split like
    a shell line, `{port}` and `{data_dir}` substituted) so the harness itself, including the
    restart test, can be checked against a stand-in broker.
    """
    template = os.environ.get("HK_COMPAT_BROKER_CMD")
    if template:
        import shlex

        return [part.format(port=port, data_dir=str(data_dir)) for part in shlex.split(template)]
    return [
        sys.executable,
        "-m",
        "broker",
        "serve",
        "--data-dir",
        str(data_dir),
        "--listen",
        f"127.0.0.1:{port}",
    ]


def new_broker(
    workdir: Path, data_dir: Path | None = None, port: int | None = None, extra: Sequence[str] = ()
) -> Broker:
    """A not-yet-started broker of ours (or of HK_COMPAT_BROKER_CMD) under workdir;
    `extra` flags are appended to its command (e.g. --node-id 1 to match the oracle)."""
    data_dir = data_dir or workdir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path = workdir / "broker.log"
    broker_logs.watch(log_path)  # conftest fails the test if this broker logs an internal error
    return Broker(
        host="127.0.0.1",
        port=port,
        data_dir=data_dir,
        argv=[*broker_argv(data_dir, port), *extra],
        log_path=log_path,
        env=env,
    )


@contextlib.contextmanager
def module_broker(prefix: str, what: str) -> Iterator[Broker]:
    """A started broker of ours on a fresh data dir in a temp dir named `prefix`..., for
    the tests of one module (`what` names them in a failure). When the with-block ends
    normally the broker must still be running and exit 0 on SIGTERM (AssertionError with
    its log tail otherwise); however it ends, the broker is stopped and the dir removed."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        broker = new_broker(Path(tmp))
        broker.start()
        try:
            yield broker
        finally:
            alive = broker.alive()
            code = broker.stop()
            tail = broker.log_tail()
        assert alive, f"hyperkafka died during {what}\n{tail}"
        assert code == 0, f"hyperkafka exited {code} on SIGTERM\n{tail}"


@contextlib.contextmanager
def configured_broker(
    workdir: Path,
    properties: Mapping[str, str],
    *,
    data_dir: Path | None = None,
    port: int | None = None,
    what: str = "the test",
) -> Iterator[Broker]:
    """A started broker of ours run with `--config workdir/server.properties` (`properties`).

    If the properties name `listeners`, those are the broker's and the harness's `--listen`
    is left out (`port` must then be the PLAINTEXT listener's, which the harness probes).
    When the with-block ends normally, a broker it did not stop itself must still be running
    and exit 0 on SIGTERM (BrokerError otherwise); however it ends, the broker is killed if
    it is still alive.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "server.properties"
    conf.write_text("".join(f"{k}={v}\n" for k, v in properties.items()))
    b = new_broker(workdir, data_dir=data_dir, port=port, extra=["--config", str(conf)])
    if "listeners" in properties and "--listen" in b.argv:
        i = b.argv.index("--listen")
        del b.argv[i : i + 2]
    try:
        b.start()
        yield b
        if b.proc is not None:
            status = b.proc.poll()
            if status is not None:
                raise BrokerError(f"broker died during {what} with status {status}\n" + b.log_tail())
            status = b.stop()
            if status != 0:
                raise BrokerError(f"broker exited {status} after SIGTERM (expected 0)\n" + b.log_tail())
    finally:
        b.kill()


def external_broker() -> Broker | None:
    """The broker named by HK_COMPAT_BOOTSTRAP, if any."""
    spec = os.environ.get("HK_COMPAT_BOOTSTRAP")
    if not spec:
        return None
    host, port = parse_host_port(spec)
    return Broker(host=host, port=port)


def tmp_workdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


# ----------------------------------------------------------------------------------------
# External clients


def require(condition: bool, reason: str) -> None:
    """Skip (laptop) or fail (CI=true) a test whose client is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required client missing in CI: {reason}", pytrace=False)
    print(f"SKIP: {reason}", file=sys.stderr)
    pytest.skip(reason)


@dataclass(frozen=True)
class Kcat:
    """One kcat binary plus the librdkafka it runs on."""

    name: str
    path: str
    env: dict[str, str]
    librdkafka: str

    def run(
        self,
        args: Sequence[str],
        *,
        input: bytes | None = None,
        timeout: float = 120.0,
        check: bool = True,
    ) -> subprocess.CompletedProcess[bytes]:
        proc = subprocess.run(
            [self.path, *args],
            input=input,
            capture_output=True,
            env=self.env,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            err = proc.stderr.decode("utf-8", "replace")
            # The matrix shows a failure's first line: make it the cause, not the command.
            causes = [ln for ln in err.splitlines() if "ERROR" in ln or "FAIL" in ln]
            raise AssertionError(
                f"{self.name} exited {proc.returncode}: {causes[-1] if causes else '?'}\n"
                f"command: {self.name} {' '.join(args)}\nstderr:\n{err[-4000:]}"
            )
        return proc


_KCAT_VERSION = re.compile(rb"librdkafka (\d+\.\d+\.\d+)")


def _kcat_librdkafka(path: str, env: dict[str, str]) -> str | None:
    try:
        out = subprocess.run([path, "-V"], capture_output=True, env=env, timeout=10, check=False)
    except OSError:
        return None
    m = _KCAT_VERSION.search(out.stdout + out.stderr)
    return m.group(1).decode() if m else None


def find_kcat(flavour: str) -> tuple[Kcat | None, str]:
    """("old" | "new") -> (Kcat, "") or (None, why not).

    "old" is Debian's kcat on its own librdkafka (2.0.x); "new" is the same binary run on
    the librdkafka that the confluent-kafka wheel ships, copied into compat_tests/.tools by
    scripts/test.
    """
    path = shutil.which("kcat")
    if path is None:
        return (
            None,
            "kcat is not installed (Debian: apt-get install -y kcat; scripts/test does it as root)",
        )
    env = dict(os.environ)
    env.pop("LD_LIBRARY_PATH", None)
    if flavour == "new":
        lib = TOOLS_DIR / "librdkafka.so.1"
        if not lib.exists():
            return (
                None,
                f"{lib.relative_to(ROOT)} missing (scripts/test copies it from the confluent-kafka wheel)",
            )
        env["LD_LIBRARY_PATH"] = str(TOOLS_DIR)
    version = _kcat_librdkafka(path, env)
    if version is None:
        return None, f"{path} -V did not report a librdkafka version"
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    if flavour == "old" and major_minor >= (2, 11):
        return None, f"system kcat runs on librdkafka {version}, not an old (<2.11) one"
    if flavour == "new" and major_minor < (2, 11):
        return None, f"LD_LIBRARY_PATH kcat still runs on librdkafka {version}"
    return Kcat(name=f"kcat-{flavour}", path=path, env=env, librdkafka=version), ""


def find_node_kafkajs() -> tuple[str | None, str]:
    node = shutil.which("node")
    if node is None:
        return None, "node is not installed"
    if not (JS_DIR / "node_modules" / "kafkajs" / "package.json").exists():
        return None, "kafkajs missing: run `npm ci` in compat_tests/js (scripts/test does it)"
    return node, ""


def find_hkgo() -> tuple[str | None, str]:
    """The Go client driver (franz-go and sarama) that scripts/test builds, if current."""
    if not HKGO.exists():
        return None, (
            f"{HKGO.relative_to(ROOT)} missing: scripts/test builds it from compat_tests/go "
            "(needs the Go toolchain)"
        )
    built = HKGO.stat().st_mtime
    sources = [p for p in GO_DIR.iterdir() if p.suffix == ".go" or p.name in ("go.mod", "go.sum")]
    newer = [p.name for p in sources if p.stat().st_mtime > built]
    if newer:
        return None, f"{HKGO.relative_to(ROOT)} is older than compat_tests/go/{newer[0]}: rerun scripts/test"
    return str(HKGO), ""


def find_kgo_suite() -> tuple[tuple[str, Path] | None, str]:
    """(franz-go's pkg/kgo test binary, the package directory it runs in), built by
    compat_tests/go/setup.sh, or None and why not."""
    binary, where = TOOLS_DIR / "kgo.test", TOOLS_DIR / "franz-go.dir"
    if not binary.exists() or not where.exists():
        return None, (
            f"{binary.relative_to(ROOT)} missing: scripts/test builds it (compat_tests/go/setup.sh, "
            "needs the Go toolchain)"
        )
    pkg = Path(where.read_text().strip()) / "pkg" / "kgo"
    if not pkg.is_dir():
        return None, f"franz-go's pkg/kgo is not in the module cache at {pkg}: rerun scripts/test"
    return (str(binary), pkg), ""


@contextlib.contextmanager
def raw_connection(broker: Broker, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    s = socket.create_connection((broker.host, broker.port), timeout=timeout)
    try:
        yield s
    finally:
        s.close()
