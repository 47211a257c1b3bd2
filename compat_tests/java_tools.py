"""Apache Kafka's own Java tools and broker, run from the jars `compat_tests/java/setup.sh` fetched.

Owns:
- finding the classpath folder (`java_lib`, `require_java`) and the Kafka release in it;
- `JavaTools`: the command-line tools of kafka-tools (`kafka-topics`, the console producer
  and consumer, `kafka-consumer-groups`, the producer/consumer performance tools,
  `GetOffsetShell`), each run as `java -cp <lib>/* CLASS ...` in a child process with a
  timeout, returning a `ToolResult` or raising a typed `JavaToolsError`;
- `KAFKA_TOOLS` and `main`: the tools by their usual names, for `scripts/kafka-tools`;
- `KafkaOracle`: a real Apache Kafka KRaft single node (broker and controller in one JVM)
  formatted and started from the same jars on loopback ports, for differential tests.

The tools, the client and the oracle are one Kafka release, pinned in compat_tests/java/pom.xml.
Imports the standard library only (pytest only inside `require_java`), so it can be used
from any test module or by hand:

    tools = JavaTools(require_java())
    with KafkaOracle(tools, Path(tmp)) as kafka:
        tools.topics(kafka.bootstrap, "--list")
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parent.parent
JAVA_DIR = ROOT / "compat_tests" / "java"
DEFAULT_LIB = ROOT / "compat_tests" / ".tools" / "java-lib"
LOG4J_CONFIG = JAVA_DIR / "log4j2.properties"

# The tool and broker entry points, as the kafka-*.sh scripts of the 4.x distribution name them.
TOPIC_COMMAND = "org.apache.kafka.tools.TopicCommand"
CONSOLE_PRODUCER = "org.apache.kafka.tools.ConsoleProducer"
CONSOLE_CONSUMER = "org.apache.kafka.tools.consumer.ConsoleConsumer"
CONSUMER_GROUP_COMMAND = "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand"
PRODUCER_PERFORMANCE = "org.apache.kafka.tools.ProducerPerformance"
CONSUMER_PERFORMANCE = "org.apache.kafka.tools.ConsumerPerformance"
GET_OFFSET_SHELL = "org.apache.kafka.tools.GetOffsetShell"
KAFKA_MAIN = "kafka.Kafka"
STORAGE_TOOL = "kafka.tools.StorageTool"

# Every tool `scripts/kafka-tools NAME` runs, by the name of its bin/NAME.sh script in the
# Kafka 4.x distribution, with the main class that script runs. A test checks each class
# is in the pinned jars.
KAFKA_TOOLS: dict[str, str] = {
    "kafka-acls": "org.apache.kafka.tools.AclCommand",
    "kafka-broker-api-versions": "org.apache.kafka.tools.BrokerApiVersionsCommand",
    "kafka-client-metrics": "org.apache.kafka.tools.ClientMetricsCommand",
    "kafka-cluster": "org.apache.kafka.tools.ClusterTool",
    "kafka-configs": "kafka.admin.ConfigCommand",
    "kafka-console-consumer": CONSOLE_CONSUMER,
    "kafka-console-producer": CONSOLE_PRODUCER,
    "kafka-console-share-consumer": "org.apache.kafka.tools.consumer.ConsoleShareConsumer",
    "kafka-consumer-groups": CONSUMER_GROUP_COMMAND,
    "kafka-consumer-perf-test": CONSUMER_PERFORMANCE,
    "kafka-delegation-tokens": "org.apache.kafka.tools.DelegationTokenCommand",
    "kafka-delete-records": "org.apache.kafka.tools.DeleteRecordsCommand",
    "kafka-e2e-latency": "org.apache.kafka.tools.EndToEndLatency",
    "kafka-features": "org.apache.kafka.tools.FeatureCommand",
    "kafka-get-offsets": GET_OFFSET_SHELL,
    "kafka-groups": "org.apache.kafka.tools.GroupsCommand",
    "kafka-leader-election": "org.apache.kafka.tools.LeaderElectionCommand",
    "kafka-log-dirs": "org.apache.kafka.tools.LogDirsCommand",
    "kafka-metadata-quorum": "org.apache.kafka.tools.MetadataQuorumCommand",
    "kafka-producer-perf-test": PRODUCER_PERFORMANCE,
    "kafka-reassign-partitions": "org.apache.kafka.tools.reassign.ReassignPartitionsCommand",
    "kafka-share-groups": "org.apache.kafka.tools.consumer.group.ShareGroupCommand",
    "kafka-streams-groups": "org.apache.kafka.tools.streams.StreamsGroupCommand",
    "kafka-topics": TOPIC_COMMAND,
    "kafka-transactions": "org.apache.kafka.tools.TransactionsCommand",
    "kafka-verifiable-consumer": "org.apache.kafka.tools.VerifiableConsumer",
    "kafka-verifiable-producer": "org.apache.kafka.tools.VerifiableProducer",
}

# A formatter that prints nothing: the console consumer then only reports its count.
NOOP_FORMATTER = "org.apache.kafka.tools.consumer.NoOpMessageFormatter"

_PROCESSED = re.compile(rb"Processed a total of (\d+) messages")


class JavaToolsError(Exception):
    """Base class: something about the Java tools or the oracle went wrong."""


class JavaUnavailable(JavaToolsError):
    """No java binary, or no classpath folder (setup.sh has not run)."""


class ToolFailed(JavaToolsError):
    """A tool exited non-zero (with `check=True`)."""

    def __init__(self, result: ToolResult) -> None:
        self.result = result
        super().__init__(
            f"{result.main_class} exited {result.returncode} after {result.seconds:.1f}s\n"
            f"stderr (tail):\n{result.stderr_tail()}"
        )


class ToolTimeout(JavaToolsError):
    """A tool ran past its timeout; it was killed, and its output so far is attached."""

    def __init__(self, main_class: str, timeout: float, stdout: bytes, stderr: bytes) -> None:
        self.main_class = main_class
        self.stdout = stdout
        self.stderr = stderr
        tail = stderr.decode("utf-8", "replace")[-3000:]
        super().__init__(f"{main_class} still running after {timeout:.0f}s; killed.\n{tail}")


class OracleError(JavaToolsError):
    """The Kafka oracle broker did not format, start, answer or stop."""


@dataclass
class ToolResult:
    main_class: str
    argv: list[str]
    returncode: int
    stdout: bytes
    stderr: bytes
    seconds: float

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    def stderr_tail(self, chars: int = 3000) -> str:
        return self.stderr.decode("utf-8", "replace")[-chars:]

    def processed(self) -> int | None:
        """The console consumer's closing "Processed a total of N messages" count, if any."""
        m = _PROCESSED.search(self.stderr) or _PROCESSED.search(self.stdout)
        return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------- discovery


def java_lib(lib_dir: Path | None = None) -> Path | None:
    """The classpath folder if it holds kafka-clients, kafka-tools and the broker jars."""
    lib = lib_dir or Path(os.environ.get("HK_JAVA_LIB", str(DEFAULT_LIB)))
    if not lib.is_dir():
        return None
    names = {p.name for p in lib.glob("*.jar")}
    need = ("kafka-clients-", "kafka-tools-", "kafka_2.13-", "kafka-server-")
    if all(any(n.startswith(prefix) for n in names) for prefix in need):
        return lib
    return None


def java_binary() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    return shutil.which("java")


def kafka_version(lib: Path) -> str:
    """The Kafka release of the jars in `lib`, read from the kafka-clients file name."""
    for p in lib.glob("kafka-clients-*.jar"):
        m = re.fullmatch(r"kafka-clients-(\d[\w.\-]*)\.jar", p.name)
        if m:
            return m.group(1)
    raise JavaUnavailable(f"no kafka-clients jar in {lib}")


def require_java(lib_dir: Path | None = None) -> Path:
    """The classpath folder, or a pytest skip (a failure under CI=true) naming the fix."""
    import pytest

    lib = java_lib(lib_dir)
    why = ""
    if java_binary() is None:
        why = "no java on PATH (install a JDK 17+)"
    elif lib is None:
        why = "no Java Kafka jars: run compat_tests/java/setup.sh"
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"Java tools required under CI: {why}")
        pytest.skip(why)
    assert lib is not None
    return lib




# ---------------------------------------------------------------------------- the tools


@dataclass
class JavaTools:
    """Runs Kafka's Java command-line tools from the jars in `lib`."""

    lib: Path
    heap: str = "-Xmx512m"
    java: str = field(default_factory=lambda: java_binary() or "java")
    # JVM flags that make a short-lived tool start faster; they change nothing it does.
    fast_start: tuple[str, ...] = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xshare:auto")

    def __post_init__(self) -> None:
        # The oracle runs with its work dir as cwd: the classpath must not be relative.
        self.lib = self.lib.resolve()

    @property
    def version(self) -> str:
        return kafka_version(self.lib)

    def command(
        self,
        main_class: str,
        args: Sequence[str],
        *,
        jvm: Sequence[str] = (),
        heap: str | None = None,
    ) -> list[str]:
        return [
            self.java,
            heap or self.heap,
            *jvm,
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
            "-Djava.awt.headless=true",
            "-cp",
            f"{self.lib}/*",
            main_class,
            *args,
        ]

    def run(
        self,
        main_class: str,
        args: Sequence[str],
        *,
        input: bytes | None = None,
        timeout: float = 120.0,
        check: bool = True,
        fast_start: bool = True,
    ) -> ToolResult:
        """Run one tool to completion; ToolTimeout past `timeout`, ToolFailed if it fails."""
        argv = self.command(main_class, args, jvm=self.fast_start if fast_start else ())
        start = time.monotonic()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            raise ToolTimeout(main_class, timeout, out, err) from None
        except BaseException:
            _kill_group(proc)
            proc.wait()
            raise
        result = ToolResult(main_class, argv, proc.returncode, out, err, time.monotonic() - start)
        if check and result.returncode != 0:
            raise ToolFailed(result)
        return result

    # -- kafka-topics -------------------------------------------------------------------

    def topics(
        self, bootstrap: str, *args: str, timeout: float = 60.0, check: bool = True
    ) -> ToolResult:
        """`kafka-topics.sh --bootstrap-server B ARGS...` (e.g. "--create", "--topic", "t")."""
        return self.run(
            TOPIC_COMMAND, ["--bootstrap-server", bootstrap, *args], timeout=timeout, check=check
        )

    # -- console producer / consumer ----------------------------------------------------

    def console_producer(
        self,
        bootstrap: str,
        topic: str,
        lines: bytes,
        *,
        reader_props: Mapping[str, str] | None = None,
        producer_props: Mapping[str, str] | None = None,
        acks: str = "-1",
        timeout: float = 120.0,
        check: bool = True,
    ) -> ToolResult:
        """Feed `lines` (one record per line) to `kafka-console-producer.sh` on stdin.

        The console producer is idempotent by default (the Java producer's default) and
        waits for acks=-1 unless told otherwise; `reader_props` go to its line reader
        (e.g. parse.key=true), `producer_props` to the KafkaProducer.
        """
        args = ["--bootstrap-server", bootstrap, "--topic", topic, "--request-required-acks", acks]
        for k, v in (reader_props or {}).items():
            args += ["--reader-property", f"{k}={v}"]
        for k, v in (producer_props or {}).items():
            args += ["--command-property", f"{k}={v}"]
        return self.run(CONSOLE_PRODUCER, args, input=lines, timeout=timeout, check=check)

    def console_consumer(
        self,
        bootstrap: str,
        topic: str,
        *,
        partition: int | None = None,
        offset: str | None = None,
        group: str | None = None,
        from_beginning: bool = False,
        max_messages: int | None = None,
        timeout_ms: int | None = None,
        formatter: str | None = None,
        formatter_props: Mapping[str, str] | None = None,
        consumer_props: Mapping[str, str] | None = None,
        timeout: float = 120.0,
        check: bool = True,
    ) -> ToolResult:
        """`kafka-console-consumer.sh`: assign mode with `partition`/`offset`, else group mode.

        The records go to stdout as the formatter prints them; `ToolResult.processed()`
        reads the count the tool reports when it exits.
        """
        args = ["--bootstrap-server", bootstrap, "--topic", topic]
        if partition is not None:
            args += ["--partition", str(partition)]
        if offset is not None:
            args += ["--offset", offset]
        if group is not None:
            args += ["--group", group]
        if from_beginning:
            args.append("--from-beginning")
        if max_messages is not None:
            args += ["--max-messages", str(max_messages)]
        if timeout_ms is not None:
            args += ["--timeout-ms", str(timeout_ms)]
        if formatter is not None:
            args += ["--formatter", formatter]
        for k, v in (formatter_props or {}).items():
            args += ["--formatter-property", f"{k}={v}"]
        for k, v in (consumer_props or {}).items():
            args += ["--command-property", f"{k}={v}"]
        return self.run(CONSOLE_CONSUMER, args, timeout=timeout, check=check)

    # -- kafka-consumer-groups ----------------------------------------------------------

    def consumer_groups(
        self, bootstrap: str, *args: str, timeout: float = 60.0, check: bool = True
    ) -> ToolResult:
        """`kafka-consumer-groups.sh --bootstrap-server B ARGS...` (e.g. "--list")."""
        return self.run(
            CONSUMER_GROUP_COMMAND,
            ["--bootstrap-server", bootstrap, *args],
            timeout=timeout,
            check=check,
        )

    # -- performance tools --------------------------------------------------------------

    def producer_perf(
        self,
        bootstrap: str,
        topic: str,
        *,
        num_records: int,
        record_size: int,
        throughput: int = -1,
        producer_props: Mapping[str, str] | None = None,
        timeout: float = 240.0,
    ) -> ToolResult:
        """`kafka-producer-perf-test.sh`; its last stdout line is the summary."""
        args = [
            "--bootstrap-server", bootstrap,
            "--topic", topic,
            "--num-records", str(num_records),
            "--record-size", str(record_size),
            "--throughput", str(throughput),
        ]  # fmt: skip
        if producer_props:
            args += ["--command-property", *(f"{k}={v}" for k, v in producer_props.items())]
        # A long run: the full JIT pays for itself, so no fast-start flags here.
        return self.run(PRODUCER_PERFORMANCE, args, timeout=timeout, fast_start=False)

    def consumer_perf(
        self,
        bootstrap: str,
        topic: str,
        *,
        num_records: int,
        group: str | None = None,
        timeout_ms: int = 30_000,
        timeout: float = 240.0,
    ) -> ToolResult:
        """`kafka-consumer-perf-test.sh` (subscribes with a consumer group)."""
        args = [
            "--bootstrap-server", bootstrap,
            "--topic", topic,
            "--num-records", str(num_records),
            "--timeout", str(timeout_ms),
        ]  # fmt: skip
        if group is not None:
            args += ["--group", group]
        return self.run(CONSUMER_PERFORMANCE, args, timeout=timeout, fast_start=False)

    def end_offsets(self, bootstrap: str, topic: str, *, time_spec: str = "-1") -> dict[int, int]:
        """`kafka-get-offsets.sh`: partition -> offset at `time_spec` (-1 latest, -2 earliest)."""
        res = self.run(
            GET_OFFSET_SHELL,
            ["--bootstrap-server", bootstrap, "--topic", topic, "--time", time_spec],
            timeout=60,
        )
        out: dict[int, int] = {}
        for line in res.text.splitlines():
            parts = line.strip().split(":")
            if len(parts) == 3 and parts[0] == topic:
                out[int(parts[1])] = int(parts[2])
        return out


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a child we started and anything it started (it leads its own session)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


# ---------------------------------------------------------------------------- the oracle


def random_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding (22 chars).

    Never one that starts with "-", as Kafka's own `Uuid.randomUuid()` never gives: about
    one id in 64 would, and `kafka-storage format -t -xyz...` reads it as an option and
    exits with its usage (seen once in a benchmark run)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not text.startswith("-"):
            return text


def metadata_broker_count(host: str, port: int, timeout: float = 2.0) -> int | None:
    """Brokers listed in a Metadata v1 response for no topics, or None if no answer.

    The oracle answers ApiVersions before it has registered itself; it is ready for
    clients only once Metadata lists a broker (and so a controller) too.
    """
    client_id = b"hk-oracle-probe"
    correlation_id = 0x4F52_4143
    # Metadata v1 (header v1): an empty topic array asks for no topics.
    body = struct.pack(">hhih", 3, 1, correlation_id, len(client_id)) + client_id
    body += struct.pack(">i", 0)
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(struct.pack(">i", len(body)) + body)
            head = _recv_exact(s, 12)
    except OSError:
        return None
    if head is None:
        return None
    _size, got, brokers = struct.unpack(">iii", head)
    return int(brokers) if got == correlation_id else None


def _recv_exact(s: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class KafkaOracle:
    """A real Apache Kafka single node (KRaft, combined broker+controller) on loopback.

    `workdir` holds server.properties, the log dir and the JVM's output (`kafka.log`).
    `overrides` are added to (or replace) the generated server.properties lines;
    `format_args` are added to `kafka-storage format` (e.g. `--add-scram` credentials).
    """

    def __init__(
        self,
        tools: JavaTools,
        workdir: Path,
        *,
        node_id: int = 1,
        heap: str = "-Xmx512m",
        overrides: Mapping[str, str] | None = None,
        format_args: Sequence[str] = (),
    ) -> None:
        self.tools = tools
        self.format_args = tuple(format_args)
        self.workdir = workdir
        self.node_id = node_id
        self.heap = heap
        # (imported here: run as scripts/kafka-tools, this module has no package)
        from compat_tests.ports import free_port

        self.port = free_port()
        self.controller_port = free_port()  # never the same: ports hands none out twice
        self.cluster_id = random_cluster_id()
        self.log_path = workdir / "kafka.log"
        self.properties_path = workdir / "server.properties"
        self.overrides = dict(overrides or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def properties(self) -> dict[str, str]:
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": f"{self.node_id}@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.workdir / "logs"),
            "num.partitions": "1",
            # One node: every internal topic must fit on it.
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
        }
        props.update(self.overrides)
        return props

    def format(self, timeout: float = 90.0) -> None:
        """Write server.properties and format the log dir (kafka-storage.sh format)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        text = "".join(f"{k}={v}\n" for k, v in self.properties().items())
        self.properties_path.write_text(text)
        try:
            self.tools.run(
                STORAGE_TOOL,
                [
                    "format",
                    "-t",
                    self.cluster_id,
                    "-c",
                    str(self.properties_path),
                    *self.format_args,
                ],
                timeout=timeout,
            )
        except JavaToolsError as exc:
            raise OracleError(f"kafka-storage format failed: {exc}") from exc

    def start(self, timeout: float = 90.0) -> None:
        """Format, start `kafka.Kafka`, and wait until Metadata lists this node."""
        t0 = time.monotonic()
        self.spawn()
        self.wait_ready(timeout, t0=t0)

    def spawn(self) -> None:
        """Format and start `kafka.Kafka` without waiting: the nodes of a controller quorum
        (`controller.quorum.voters` naming several) answer only once a majority runs, so
        a cluster spawns them all, then waits for each."""
        if self.proc is not None:
            raise OracleError("already started")
        self.format()
        argv = self.tools.command(
            KAFKA_MAIN,
            [str(self.properties_path)],
            jvm=(f"-Xms{self.heap.removeprefix('-Xmx')}", "-XX:+UseG1GC"),
            heap=self.heap,
        )
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(
        self, timeout: float = 90.0, *, brokers: int = 1, t0: float | None = None
    ) -> None:
        """Wait until Metadata lists `brokers` nodes; killed and OracleError if it does not."""
        if self.proc is None:
            raise OracleError("not started")
        t0 = time.monotonic() if t0 is None else t0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise OracleError(f"kafka.Kafka exited {code} while starting\n{self.log_tail()}")
            if (metadata_broker_count("127.0.0.1", self.port) or 0) >= brokers:
                self.start_seconds = time.monotonic() - t0
                return
            time.sleep(0.25)
        self.kill()
        raise OracleError(f"kafka.Kafka did not answer within {timeout:.0f}s\n{self.log_tail()}")

    def stop(self, timeout: float = 45.0) -> int:
        """SIGTERM (a controlled shutdown), wait, return the exit status."""
        proc, self.proc = self.proc, None
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            raise OracleError(
                f"kafka.Kafka pid {proc.pid} ignored SIGTERM for {timeout:.0f}s; killed.\n"
                + self.log_tail()
            ) from None

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            _kill_group(proc)
            proc.wait()

    def log_tail(self, lines: int = 60) -> str:
        if not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_bytes().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> KafkaOracle:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.stop()
        else:
            self.kill()


# ---------------------------------------------------------------------------- scripts/kafka-tools

SETUP_SCRIPT = JAVA_DIR / "setup.sh"


def tool_class(name: str) -> str | None:
    """The main class of a tool named as its script is (`kafka-topics` or `kafka-topics.sh`)."""
    return KAFKA_TOOLS.get(name.removesuffix(".sh"))


def main(argv: Sequence[str]) -> int:
    """`scripts/kafka-tools NAME ARGS...`: fetch the pinned jars on first use, then become
    the tool (exec, so stdin, signals and the exit status are the tool's own)."""
    import sys

    def fail(message: str) -> int:
        print(f"hyperkafka: {message}", file=sys.stderr)
        return 2

    if not argv or argv[0] in ("-h", "--help", "help"):
        print(
            "usage: scripts/kafka-tools NAME [ARGS...]   (Apache Kafka's own tools)\n\n"
            + "\n".join(KAFKA_TOOLS)
        )
        return 0 if argv else 2
    main_class = tool_class(argv[0])
    if main_class is None:
        return fail(f"no Kafka tool named {argv[0]!r}; scripts/kafka-tools --help lists them")
    if java_binary() is None:
        return fail(
            "the Kafka tools need java: install a JDK 17+ (e.g. apt-get install openjdk-17-jdk-headless)"
        )
    lib = java_lib()
    if lib is None:
        if shutil.which("mvn") is None:
            return fail("fetching the Kafka tools needs Maven (e.g. apt-get install maven)")
        # setup.sh says what it fetches on stderr-bound lines; keep the tool's stdout clean.
        done = subprocess.run(["bash", str(SETUP_SCRIPT)], stdout=sys.stderr, check=False)
        lib = java_lib()
        if done.returncode != 0 or lib is None:
            return fail(
                f"could not fetch the Kafka jars ({SETUP_SCRIPT.relative_to(ROOT)} exited {done.returncode})"
            )
    tools = JavaTools(lib)
    argv_java = tools.command(main_class, argv[1:], jvm=tools.fast_start)
    sys.stdout.flush()
    os.execv(argv_java[0], argv_java)
    return 1  # not reached


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
