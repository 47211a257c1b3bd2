"""Coverage-guided fuzz targets (atheris, libFuzzer) over the codec and record validation.

Run one as a process of its own (a native abort, such as kio's Rust reader aborting on a
huge compact count, then ends only that process; libFuzzer saves the input):

    python -m compat_tests.attack.atheris_targets TARGET [libFuzzer flags] NEW_CORPUS SEED_CORPUS

Targets (each asserts that only the decoder's typed errors escape):
- codec: `decode_request` with the versions the broker advertises, both paths (kio and the
  hand-written fast path), and the Produce fast path directly when the header says Produce;
- records: `validate_batch(..., decode=True)` and `iter_records`, with the CRC as sent and
  with the CRC made right (so mutations reach the records, not only the checksum).

`run_target()` (no atheris import) runs one as a subprocess for the tests and scripts/fuzz;
`write_seed_corpus()` regenerates the seed corpus kept in compat_tests/attack/corpus/.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus"
TARGETS = ("codec", "records")
SASL_RANGES = {17: (0, 1), 36: (0, 2)}


def _codec_target() -> Callable[[bytes], None]:
    from broker.protocol import RECOMMENDED_RANGES, ProtocolError, decode_request
    from broker.protocol._wire import skip_tagged_fields
    from broker.protocol.fastpath import PRODUCE_VERSIONS, decode_produce_request
    from broker.protocol.header import is_flexible_request, parse_request_header

    ranges = {**RECOMMENDED_RANGES, **SASL_RANGES}

    def one(data: bytes) -> None:
        for fast in (True, False):
            with contextlib.suppress(ProtocolError):
                decode_request(data, supported=ranges, fast=fast)
        try:
            header, pos = parse_request_header(data, header_version=1)
        except ProtocolError:
            return
        if header.api_key == 0 and header.api_version in PRODUCE_VERSIONS:
            try:
                if is_flexible_request(0, header.api_version):
                    pos = skip_tagged_fields(data, pos)
                decode_produce_request(data, pos, header.api_version)
            except ProtocolError:
                pass
            except Exception as exc:
                if type(exc).__name__ in ("_Short", "_Bad"):
                    return  # skip_tagged_fields' own signals, before the decoder
                raise

    return one


def _records_target() -> Callable[[bytes], None]:
    import crc32c

    from broker.protocol.errors import RecordBatchError
    from broker.protocol.records import iter_records, split_batches, validate_batch

    def one(data: bytes) -> None:
        candidates = [data]
        if len(data) >= 61:
            fixed = bytearray(data)
            struct.pack_into(">I", fixed, 17, crc32c.crc32c(bytes(data[21:])))
            candidates.append(bytes(fixed))
        for batch in candidates:
            with contextlib.suppress(RecordBatchError):
                validate_batch(batch, check_crc=True, decode=True)
            with contextlib.suppress(RecordBatchError):
                for _ in iter_records(batch):
                    pass
        with contextlib.suppress(RecordBatchError):
            split_batches(data)

    return one


def main(argv: list[str]) -> int:
    import atheris  # type: ignore[import-untyped]

    if not argv or argv[0] not in TARGETS:
        print(f"usage: atheris_targets {{{','.join(TARGETS)}}} [libFuzzer flags] [corpus dirs]")
        return 2
    with atheris.instrument_imports(include=["broker.protocol"]):
        import broker.protocol.codec
        import broker.protocol.fastpath
        import broker.protocol.records  # noqa: F401
    one = _codec_target() if argv[0] == "codec" else _records_target()
    atheris.Setup([sys.argv[0], *argv[1:]], one)
    atheris.Fuzz()
    return 0


# ---------------------------------------------------------------- running a target


@dataclass
class AtherisRun:
    target: str
    returncode: int
    output: str
    crash: Path | None
    execs: int | None

    def crash_hex(self) -> str:
        if self.crash is None:
            return ""
        data = self.crash.read_bytes()
        return data[:4096].hex() + ("..." if len(data) > 4096 else "")


def atheris_available() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def run_target(target: str, seconds: float, workdir: Path, *, seed: int = 0,
               env: dict[str, str] | None = None) -> AtherisRun:  # fmt: skip
    """Fuzz `target` for `seconds` (0: only replay the seed corpus) in a child process.
    New inputs go to workdir/corpus; a crashing input to workdir/crash-*."""
    new = workdir / "corpus"
    new.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "compat_tests.attack.atheris_targets", target,
        f"-seed={seed}", "-timeout=20", "-rss_limit_mb=3072", "-max_len=8192",
        f"-artifact_prefix={workdir}{os.sep}", "-print_final_stats=1",
    ]  # fmt: skip
    argv += ["-runs=0"] if seconds <= 0 else [f"-max_total_time={int(seconds)}"]
    argv += [str(new), str(CORPUS / target)]
    proc_env = dict(env or os.environ)
    root = str(Path(__file__).resolve().parents[2])
    proc_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, proc_env.get("PYTHONPATH", "")) if p)
    out = subprocess.run(argv, cwd=root, env=proc_env, capture_output=True, text=True,
                         timeout=seconds + 300)  # fmt: skip
    text = out.stdout + out.stderr
    crashes = (
        sorted(workdir.glob("crash-*"))
        + sorted(workdir.glob("timeout-*"))
        + sorted(workdir.glob("oom-*"))
    )
    execs = None
    for line in text.splitlines():
        if "stat::number_of_executed_units:" in line:
            execs = int(line.split(":")[-1])
    return AtherisRun(target, out.returncode, text, crashes[0] if crashes else None, execs)


# ---------------------------------------------------------------- the seed corpus


def _vectors() -> list[Path]:
    root = Path(__file__).resolve().parents[2] / "broker" / "tests" / "vectors"
    return sorted(root.glob("*_request_*.bin"))


def seed_inputs() -> dict[str, dict[str, bytes]]:
    """target -> file name -> bytes, small files only."""
    from broker.protocol import RECOMMENDED_RANGES, decode_request
    from broker.protocol import records as rec

    from . import batches
    from .schema_fuzz import make_frame

    codec: dict[str, bytes] = {}
    produce_batches: list[bytes] = []
    for p in _vectors():
        payload = p.read_bytes()[4:]
        if len(payload) <= 4096:
            codec[p.stem] = payload
        if p.name.startswith("produce_request_"):
            for t in decode_request(payload)[1].topic_data:
                for part in t.partition_data:
                    produce_batches += [bytes(b) for b in rec.split_batches(part.records)]
    ranges = {**RECOMMENDED_RANGES, **SASL_RANGES}
    n_targets = sum(hi - lo + 1 for lo, hi in ranges.values())
    for i in range(n_targets):
        ff = make_frame(1, "valid", i, ranges)
        codec[f"valid_api{ff.api_key}_v{ff.version}"] = ff.data[4:]
    # Item 1 of issue 15: one frame with a compact array count of 0xF0000000.
    codec["regression_metadata_v12_count_f0000000"] = (
        struct.pack(">hhih", 3, 12, 1, 2)
        + b"hk"
        + b"\x00"
        + b"\x80\x80\x80\x80\x0f"
        + b"\x01\x00\x00"
    )
    records: dict[str, bytes] = {}
    for i, b in enumerate(produce_batches):
        if len(b) <= 4096:
            records[f"vector_{i:02d}"] = b
    for cls, builders in batches.ATTACKS.items():
        if cls.startswith("bomb-"):
            continue
        for name, build in builders().items():
            data = build()
            if len(data) <= 4096:
                records[f"{cls}_{name}"] = data
    rng = random.Random(7)
    for codec_name, c in batches.CODEC.items():
        raw = batches.records(5, value=rng.randbytes(40))
        records[f"good_{codec_name}"] = batches.batch(batches.compress(codec_name, raw), 5, codec=c)
    return {"codec": codec, "records": records}


def write_seed_corpus() -> dict[str, int]:
    """Regenerate compat_tests/attack/corpus/<target>/ (names say where each input came from)."""
    counts = {}
    for target, inputs in seed_inputs().items():
        d = CORPUS / target
        d.mkdir(parents=True, exist_ok=True)
        for old in d.iterdir():
            old.unlink()
        for name, data in inputs.items():
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
            (d / f"{safe}-{hashlib.sha1(data).hexdigest()[:8]}").write_bytes(data)
        counts[target] = len(inputs)
    return counts


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
