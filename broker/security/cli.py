"""`hyperkafka users add|remove|list`: manage the SASL credential file.

Passwords are read from stdin (`--password-stdin`) or prompted for without echo; never
taken from argv, where `ps` would show them. Imports the standard library and `.users`.
"""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path

from broker.security.scram import MIN_ITERATIONS
from broker.security.users import UserStore, UserStoreError


def add_users_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    users = sub.add_parser("users", help="manage SASL users (PLAIN and SCRAM-SHA-256/512 logins)")
    users.add_argument("--data-dir", type=Path, default=Path("hyperkafka-data"))
    actions = users.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="add a user or change its password")
    add.add_argument("name")
    add.add_argument("--password-stdin", action="store_true", help="read the password from the first line of stdin")
    add.add_argument("--iterations", type=int, default=MIN_ITERATIONS, help=f"PBKDF2 iterations (default {MIN_ITERATIONS})")
    remove = actions.add_parser("remove", help="remove a user")
    remove.add_argument("name")
    actions.add_parser("list", help="list users and their mechanisms")


def users_command(args: argparse.Namespace) -> int:
    store = UserStore.in_data_dir(args.data_dir)
    try:
        if args.action == "list":
            for name in store.names():
                print(f"{name}\t{','.join(store.mechanisms(name))}")
            return 0
        if args.action == "remove":
            if not store.remove(args.name):
                print(f"hyperkafka: no user {args.name!r}", file=sys.stderr)
                return 1
            return 0
        if args.password_stdin:
            password = sys.stdin.readline().rstrip("\r\n")
        elif not sys.stdin.isatty():
            # getpass would fall back to reading an echoed line, or die at end of input.
            print(f"hyperkafka: no terminal to ask for {args.name}'s password: give it on stdin with --password-stdin",
                  file=sys.stderr)
            return 2
        else:
            password = getpass.getpass(f"password for {args.name}: ")
            if getpass.getpass("again: ") != password:
                print("hyperkafka: the passwords differ", file=sys.stderr)
                return 1
        store.add(args.name, password, iterations=args.iterations)
        return 0
    except (UserStoreError, ValueError, OSError) as exc:
        print(f"hyperkafka: {exc}", file=sys.stderr)
        return 1
