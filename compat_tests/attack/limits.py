"""Run a command under a lower RLIMIT_NOFILE: `python -m compat_tests.attack.limits
--nofile N -- ARGV...` sets the limit and execs ARGV (same pid), so an attack can show what a
broker does at a budget such as the common 1024 without changing the test process's own.
Standard library only.
"""

from __future__ import annotations

import os
import resource
import sys


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[0] != "--nofile" or argv[2] != "--":
        print("usage: limits --nofile N -- ARGV...", file=sys.stderr)
        return 2
    n = int(argv[1])
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, min(n, hard) if hard >= 0 else n))
    os.execvp(argv[3], argv[3:])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
