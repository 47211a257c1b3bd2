#!/opt/hyperkafka/bin/python
"""The image's entrypoint: `hyperkafka serve` by default, anything else as given.

    hyperkafka-entrypoint [serve FLAGS...]   hyperkafka serve FLAGS...
    hyperkafka-entrypoint keys|verify ...    hyperkafka keys|verify ... (--data-dir: KAFKA_LOG_DIRS)
    hyperkafka-entrypoint PROGRAM ARGS...    PROGRAM ARGS... (e.g. hyperkafka-demo-client)

`hyperkafka serve` reads the KAFKA_* variables of the environment itself, by the
convention of Kafka's own images (broker/config_sources.py), so nothing is translated
here. `keys` and `verify` read no settings: they get the volume as --data-dir.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

COMMANDS = ("keys", "verify")


def command(args: list[str], environ: Mapping[str, str]) -> list[str]:
    """The argv to exec for the container's arguments `args`."""
    if not args or args[0] == "serve":
        return ["hyperkafka", "serve", *args[1:]]
    if args[0] in COMMANDS:
        argv = ["hyperkafka", *args]
        # The volume, not ./hyperkafka-data (these commands have no --config to read it from).
        if "--data-dir" not in argv and "KAFKA_LOG_DIRS" in environ:
            argv += ["--data-dir", environ["KAFKA_LOG_DIRS"]]
        return argv
    return list(args)


def main() -> None:
    argv = command(sys.argv[1:], os.environ)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.exit(f"hyperkafka: cannot run {argv[0]}: {exc.strerror}")


if __name__ == "__main__":
    main()
