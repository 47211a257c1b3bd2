"""The `hyperkafka` command's entry point (also `python -m broker`).

Owns only Ctrl-C and broken pipes: a SIGINT before the broker's own signal handling is in place (while
modules load, while the data dir opens) or a second one during shutdown ends the process
with status 130 and no traceback; a reader that stops reading (`| head`) ends it as
SIGPIPE would. Everything else is broker.cli, imported inside the guard
because importing it takes a noticeable time. Imports the standard library only.
"""

from __future__ import annotations

import os
import signal
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
    except BrokenPipeError:
        # Whoever read our output stopped (`hyperkafka keys | head -1`): end as tools killed
        # by SIGPIPE do, without a traceback, and without Python's complaint at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except BaseExceptionGroup as group:
        if _only_interrupts(group):
            return 130
        raise


if __name__ == "__main__":
    sys.exit(main())
