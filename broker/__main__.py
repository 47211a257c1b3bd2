"""The `hyperkafka` command's entry point (also `python -m broker`).

Owns only Ctrl-C: a SIGINT before the broker's own signal handling is in place (while
modules load, while the data dir opens) or a second one during shutdown ends the process
with status 130 and no traceback. Everything else is broker.cli, imported inside the guard
because importing it takes a noticeable time. Imports the standard library only.
"""

from __future__ import annotations

import sys


def _only_interrupts(group: BaseExceptionGroup[BaseException]) -> bool:
    rest = group.split(KeyboardInterrupt)[1]
    return rest is None


def main() -> int:
    try:
        from broker.cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:
        return 130
    except BaseExceptionGroup as group:
        if _only_interrupts(group):
            return 130
        raise


if __name__ == "__main__":
    sys.exit(main())
