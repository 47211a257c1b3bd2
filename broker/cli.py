"""The `hyperkafka` command: `serve`, `keys`, `verify`, `audit`, `users`.

Flags override KAFKA_* environment variables, which override the properties file given
with --config, which overrides defaults.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn, cast

from broker.config import (
    BrokerConfig,
    ConfigError,
    apply_properties,
    parse_host_port,
    parse_http_listener,
    read_properties,
)
from broker.config_sources import env_name, settings_from_env
from storage import FsyncPolicy


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line starting `hyperkafka:` (its subcommands too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"hyperkafka: {message} (see: {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hyperkafka", description="A Kafka-compatible broker of signed, Hypercore-compatible archives.")
    # (its subcommands are _Parser too; typed as argparse names them for broker.security.cli)
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]", parser.add_subparsers(dest="command", required=True))

    serve = sub.add_parser("serve", help="run a broker")
    serve.add_argument("--data-dir", type=Path, help="where archives live (default ./hyperkafka-data)")
    serve.add_argument("--listen", metavar="HOST:PORT", help="address to listen on (default 127.0.0.1:9092)")
    serve.add_argument("--advertised", metavar="HOST:PORT", help="address clients are told to use (default: --listen)")
    serve.add_argument("--listeners", metavar="NAME://HOST:PORT,...", help="Kafka-style listeners (PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL); replaces --listen")
    serve.add_argument("--advertised-listeners", metavar="NAME://HOST:PORT,...", help="what clients of each listener are told to use")
    serve.add_argument("--node-id", type=int, help="this broker's id (default 0)")
    serve.add_argument("--config", type=Path, metavar="FILE", help="a server.properties-style file")
    serve.add_argument("--fsync", choices=[p.value for p in FsyncPolicy], help="when data reaches the disk before a head is signed (default interval)")
    serve.add_argument("--num-partitions", type=int, help="partitions of an auto-created topic (default 1)")
    serve.add_argument("--no-auto-create", action="store_true", help="do not create unknown topics on Metadata or Produce")
    serve.add_argument("--replication-listen", metavar="HOST:PORT", help="serve every archive over the Hypercore protocol here")
    serve.add_argument("--mirror", action="append", metavar="HOST:PORT[@NODEKEY]", help="mirror the node whose Kafka listener is HOST:PORT (repeatable); @NODEKEY (hex) pins its key")
    serve.add_argument("--http-listen", metavar="[HOST]:PORT", help="serve /metrics over HTTP here (hyperkafka.http.listeners; a bare :PORT is loopback)")
    serve.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")

    keys = sub.add_parser("keys", help="print the node key and every partition's archive key")
    keys.add_argument("--data-dir", type=Path, default=Path("hyperkafka-data"))

    from broker.security.cli import add_users_parser

    add_users_parser(sub)

    audit = sub.add_parser("audit", help="read a topic through any node's Kafka port and check every batch against its writer's signed heads")
    audit.add_argument("--bootstrap", required=True, metavar="HOST:PORT", help="the Kafka listener to read from (a mirror included)")
    audit.add_argument("--http", required=True, metavar="URL", help="the HTTP listener (hyperkafka.http.listeners) of a node holding the archives, for the proofs")
    audit.add_argument("--topic", required=True)
    audit.add_argument("--archive-key", action="append", default=[], metavar="PARTITION=HEX",
                       help="pin a partition's archive key (as `hyperkafka keys` prints it on the writer); else trusted on first use")

    verify = sub.add_parser("verify", help="check every archive offline against its signed head")
    verify.add_argument("--data-dir", type=Path, default=Path("hyperkafka-data"))
    verify.add_argument("--topic", help="only this topic")
    verify.add_argument("--progress-interval", type=float, metavar="SECONDS",
                        help="seconds between progress lines on stderr when it is no terminal (default 5)")
    return parser


def build_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> BrokerConfig:
    """Defaults, then the --config file, then KAFKA_* variables of the environment (one
    setting each, broker/config_sources.py), then the flags: each wins over the ones before."""
    config = BrokerConfig()
    props = read_properties(args.config) if args.config else {}
    from_env = settings_from_env(os.environ if environ is None else environ)
    props.update(from_env)
    if props:
        try:
            config = apply_properties(config, props)
        except ConfigError as exc:
            named = [k for k in from_env if k in str(exc)]
            if named:  # say where a bad setting came from when it was not the file
                raise ConfigError(f"{exc} (from the environment: {env_name(max(named, key=len))})") from None
            raise
    if args.data_dir:
        config.data_dir = args.data_dir
    if args.listen:
        config.listen_host, config.listen_port = parse_host_port(args.listen)
        # --listen is the PLAINTEXT listener: it replaces only that entry of a file's list.
        _set_listener(config.security_props, "listeners", args.listen)
    if args.listeners:
        config.security_props["listeners"] = args.listeners
        config.listen_host, config.listen_port = parse_host_port(args.listeners.split(",")[0])
    if args.advertised_listeners:
        config.security_props["advertised.listeners"] = args.advertised_listeners
    if args.advertised:
        config.advertised_host, config.advertised_port = parse_host_port(args.advertised)
        if "listeners" in config.security_props:
            config.security_props["advertised.listeners"] = config.security_props.get("advertised.listeners", "")
            _set_listener(config.security_props, "advertised.listeners", args.advertised)
    if args.node_id is not None:
        config.node_id = args.node_id
    if args.fsync:
        config.fsync = FsyncPolicy(args.fsync)
    if args.num_partitions is not None:
        config.num_partitions = args.num_partitions
    if args.no_auto_create:
        config.auto_create_topics = False
    if args.replication_listen:
        config.replication_listen = parse_host_port(args.replication_listen)
    if args.http_listen:
        config.http_listen = parse_http_listener(args.http_listen)
    if args.mirror:
        config.mirrors = list(args.mirror)
    if config.mirrors:
        # A Metadata request for a topic not mirrored yet must not create a local topic of
        # that name (the mirrored one could then never be attached).
        config.auto_create_topics = False
    if config.cluster_etcd_endpoints and config.replication_listen is None:
        raise ConfigError("cluster mode (hyperkafka.cluster.etcd.endpoints) needs --replication-listen "
                              "(or hyperkafka.replication.listen): the other brokers mirror this one's archives")
    from broker.security.settings import SecuritySettings

    SecuritySettings.parse(config.security_props, (config.listen_host, config.listen_port), (config.advertised_host, config.advertised_port))
    return config


def _set_listener(props: dict[str, str], key: str, address: str) -> None:
    """Put PLAINTEXT://address into the list at props[key], if there is a list."""
    if key not in props:
        return
    entries = [e.strip() for e in props[key].split(",") if e.strip() and not e.strip().upper().startswith("PLAINTEXT://")]
    props[key] = ",".join([f"PLAINTEXT://{address}", *entries])


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _skip_test_only_imports() -> None:
    """Keep Hypothesis (and the pytest it imports) out of a serving process.

    kio registers Hypothesis strategies for its types whenever it can import Hypothesis,
    so in an environment with the test extra every broker start paid about a CPU-second
    for modules it never uses (a compat run starts a broker per test). A None entry in
    sys.modules makes that optional import fail the way an absent package does.
    """
    sys.modules.setdefault("hypothesis", None)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("keys", "verify") and not args.data_dir.is_dir():
        print(f"hyperkafka: no data dir at {args.data_dir} (the --data-dir of a broker)", file=sys.stderr)
        return 2
    if args.command == "keys":
        from storage.cli import keys_command

        return keys_command(str(args.data_dir))
    if args.command == "verify":
        from storage.cli import verify_command

        return verify_command(str(args.data_dir), args.topic, progress_interval=args.progress_interval)
    if args.command == "audit":
        from broker.audit import audit_command

        return audit_command(args.bootstrap, args.http, args.topic, args.archive_key)
    if args.command == "users":
        from broker.security.cli import users_command

        return users_command(args)

    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = build_config(args)
    except (ConfigError, OSError) as exc:
        print(f"hyperkafka: {exc}", file=sys.stderr)
        return 2
    from broker.preflight import AddressInUse, check_addresses_free

    try:
        check_addresses_free(config)
    except AddressInUse as exc:  # before the data dir is made or touched
        print(f"hyperkafka: cannot start: {exc}", file=sys.stderr)
        return 1

    _skip_test_only_imports()
    import trio

    from broker.server import run
    from storage.dirlock import DataDirLocked

    failed = False
    try:
        trio.run(run, config)
    except* DataDirLocked as group:  # a second broker on one data dir: one line, untouched dir
        failed = True
        for error in _leaves(group):
            print(f"hyperkafka: cannot start: {error}", file=sys.stderr)
    except* OSError as group:  # cannot bind, data dir unusable: say so in one line
        failed = True
        for error in _leaves(group):
            print(f"hyperkafka: cannot start: {error}", file=sys.stderr)
    return 1 if failed else 0
