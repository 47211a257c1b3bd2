#!/opt/hyperkafka/bin/python
"""The image's entrypoint: `serve` configured from the environment, anything else as given.

    hyperkafka-entrypoint serve [FLAGS...]   hyperkafka serve, with KAFKA_* settings
    hyperkafka-entrypoint keys|verify ...    hyperkafka keys|verify ... (--data-dir: KAFKA_LOG_DIRS)
    hyperkafka-entrypoint PROGRAM ARGS...    PROGRAM ARGS... (e.g. hyperkafka-demo-client)

Every environment variable KAFKA_<NAME> becomes the broker setting <name> by the
convention of Kafka's own images: strip KAFKA_, lower-case, then "___" -> "-", "__" -> "_",
"_" -> ".". So KAFKA_LOG_RETENTION_MS=60000 is log.retention.ms=60000 and
KAFKA_HYPERKAFKA_MIRRORS=writer:9092 is hyperkafka.mirrors. They are written to a
server.properties-style file that `hyperkafka serve --config` reads; a --config FILE given
on the command line is read first and the environment overrides it, and command-line flags
override both (as `hyperkafka serve` always does). A setting the broker does not know
fails the start with its name, as it would in a file.
"""

from __future__ import annotations

import os
import sys
import tempfile

PREFIX = "KAFKA_"
COMMANDS = ("keys", "verify")


def env_key(name: str) -> str:
    """KAFKA_LOG_RETENTION_MS -> log.retention.ms (Kafka's image convention)."""
    body = name[len(PREFIX) :].lower()
    return (
        body.replace("___", "\0dash\0")
        .replace("__", "\0us\0")
        .replace("_", ".")
        .replace("\0dash\0", "-")
        .replace("\0us\0", "_")
    )


def properties_from_env(environ: dict[str, str]) -> dict[str, str]:
    return {
        env_key(k): v
        for k, v in sorted(environ.items())
        if k.startswith(PREFIX) and len(k) > len(PREFIX)
    }


def read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def serve_argv(args: list[str], environ: dict[str, str]) -> list[str]:
    props = properties_from_env(environ)
    if not props:
        return ["hyperkafka", "serve", *args]
    lines: list[str] = []
    rest = list(args)
    for flag in ("--config",):  # a file given explicitly is read first, the environment wins
        if flag in rest:
            i = rest.index(flag)
            lines += read_lines(rest[i + 1])
            del rest[i : i + 2]
    lines += [f"{k}={v}" for k, v in props.items()]
    fd, path = tempfile.mkstemp(prefix="hyperkafka-", suffix=".properties")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("# written by hyperkafka-entrypoint from KAFKA_* environment variables\n")
        f.write("\n".join(lines) + "\n")
    return ["hyperkafka", "serve", "--config", path, *rest]


def main() -> None:
    argv = sys.argv[1:] or ["serve"]
    if argv[0] == "serve":
        argv = serve_argv(argv[1:], dict(os.environ))
    elif argv[0] in COMMANDS:
        argv = ["hyperkafka", *argv]
        # The volume, not ./hyperkafka-data (these commands have no --config to read it from).
        if "--data-dir" not in argv and "KAFKA_LOG_DIRS" in os.environ:
            argv += ["--data-dir", os.environ["KAFKA_LOG_DIRS"]]
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.exit(f"hyperkafka: cannot run {argv[0]}: {exc.strerror}")


if __name__ == "__main__":
    main()
