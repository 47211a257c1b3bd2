"""One nemesis run: a cluster, the clients, a schedule of faults, then the checks.

Owns `run(...)` and the fault schedule. The run, in order:

1. `JepsenCluster.start`, then the producers' topic is created (3 partitions, 3 replicas).
2. The clients start in the clients' host (compat_tests/jepsen/workload.py): two
   idempotent acks=all producers, one consumer group, the per-broker commit probe, and an
   admin creating a topic a second.
3. The nemesis applies each fault of the schedule, holds it, undoes it, and lets the
   cluster recover before the next one: kill -9 and restart, SIGSTOP past the session
   timeout and SIGCONT, a silent partition of the controller alone, and one splitting
   the brokers into a majority with the controller and a minority with etcd (the
   majority loses etcd).
4. The clients stop; after the last heal the cluster gets a settling time; then the
   producers' topic is read back, committed offsets and every broker's Metadata read.
5. compat_tests/jepsen/checker.py gives the verdicts and the unavailability table.

`Report.violations` is empty when every check held. Everything the run wrote (histories,
logs, report.json) stays in the work directory for a post-mortem.

The quorum variant (`quorum=True`, issue 17): partitions signed by a quorum of their
replicas, and faults aimed at the producers' partition leaders, read from Metadata at
fault time (LEADER_FAULTS: kill -9 and restart, SIGSTOP past the session timeout and
SIGCONT, a silent cut from the other brokers and etcd, healed). After the run every
broker's copy of those partitions is read from its data dir (compat_tests/jepsen/
archives.py) for the quorum checks, and each leader fault's produce gap is held to the
session timeout plus FAILOVER_MARGIN_S.

May import the standard library and compat_tests.jepsen.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compat_tests.jepsen import checker
from compat_tests.jepsen.archives import read_copies
from compat_tests.jepsen.cluster import JepsenCluster
from compat_tests.jepsen.wire import Metadata

TOPIC = "jepsen-p"
PARTITIONS = 3
GROUP = "jepsen-g"
PROBE_GROUP = "jepsen-probe"


@dataclass
class Report:
    seconds: float
    counts: dict[str, int]
    violations: dict[str, list[str]]
    unavailability: list[dict[str, Any]]
    faults: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        return not any(self.violations.values())

    def text(self) -> str:
        lines = [
            f"nemesis run, {self.seconds:.0f} s: "
            + ", ".join(f"{k} {v}" for k, v in self.counts.items())
        ]
        lines.append(checker.table(self.unavailability))
        for check, found in self.violations.items():
            lines.append(f"{check}: {'ok' if not found else f'{len(found)} violation(s)'}")
            lines += [f"  - {v}" for v in found[:8]]
            if len(found) > 8:
                lines.append(f"  ... and {len(found) - 8} more")
        return "\n".join(lines)


def _of(events: list[dict[str, Any]], group: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("group") == group]


def _of_op(events: list[dict[str, Any]], op: str) -> list[dict[str, Any]]:
    return [e for e in events if e["op"] == op]


def _history(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Clients:
    """The workload processes, in the clients' host."""

    def __init__(self, cluster: JepsenCluster, workdir: Path) -> None:
        self.cluster, self.workdir = cluster, workdir
        self.stopfile = workdir / "stop"
        self.procs: list[subprocess.Popen[bytes]] = []

    def _argv(self, role: str, out: Path, *args: str) -> list[str]:
        return self.cluster.client_argv(
            [
                sys.executable,
                "-m",
                "compat_tests.jepsen.workload",
                role,
                str(out),
                str(self.stopfile),
                *args,
            ]
        )

    def once(self, role: str, name: str, *args: str, timeout: float = 120) -> list[dict[str, Any]]:
        out = self.workdir / f"{name}.jsonl"
        out.unlink(missing_ok=True)
        done = subprocess.run(
            self._argv(role, out, *args),
            env=self.cluster.env(),
            capture_output=True,
            timeout=timeout,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{role} failed: {done.stderr[-2000:]}")
        return _history(out)

    def start(self) -> None:
        self.stopfile.unlink(missing_ok=True)
        boot = self.cluster.bootstrap()
        roles = [
            ("producer", "producer-a", boot, TOPIC, "a"),
            ("producer", "producer-b", boot, TOPIC, "b"),
            ("consumer", "consumer", boot, TOPIC, GROUP),
            ("probe", "probe", self.cluster.broker_list(), PROBE_GROUP, TOPIC),
            ("admin", "admin", boot, "jepsen-t"),
        ]
        for role, name, *args in roles:
            log = (self.workdir / f"{name}.log").open("ab")
            self.procs.append(
                subprocess.Popen(
                    self._argv(role, self.workdir / f"{name}.jsonl", *args),
                    env=self.cluster.env(),
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            )
            log.close()

    def stop(self) -> None:
        self.stopfile.touch()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# --- the nemesis ---------------------------------------------------------------------------

# (description, apply, undo, hold, the partitions of TOPIC its victim led: only for the
# faults aimed at leaders, whose produce gap checker.failover_bound checks)
Step = tuple[str, Callable[[], None], Callable[[], None], float, list[int] | None]


def _controller(c: JepsenCluster) -> str:
    return c.controller() or c.broker_hosts[0]


def fault_kill(c: JepsenCluster, hold: float) -> Step:
    victim = _controller(c)

    def restart() -> None:
        c.restart(victim)
        c.wait_broker(victim, 60)

    return f"kill -9 {victim} (controller)", lambda: c.kill(victim), restart, hold, None


def fault_pause(c: JepsenCluster, hold: float) -> Step:
    # The probe group's coordinator (issue 16: a paused coordinator, resumed, went on
    # accepting commits); past the session timeout, so another must have taken over.
    victim = c.coordinator(f"{PROBE_GROUP}-all") or _controller(c)
    hold = max(hold, c.session_ms / 1000 + 3)
    return (
        f"SIGSTOP {victim} (coordinator) {hold:.0f}s",
        lambda: c.pause(victim),
        lambda: c.resume(victim),
        hold,
        None,
    )


def fault_isolate_controller(c: JepsenCluster, hold: float) -> Step:
    victim = _controller(c)
    rest = [h for h in c.broker_hosts if h != victim] + c.etcd_hosts
    return (
        f"partition {{{victim}}} (controller) | {{{','.join(rest)}}}",
        lambda: c.net.partition([victim], rest),
        c.net.heal,
        hold,
        None,
    )


def fault_majority(c: JepsenCluster, hold: float) -> Step:
    ctrl = _controller(c)
    others = [h for h in c.broker_hosts if h != ctrl]
    majority = [ctrl, *others[:-1]]
    minority = [others[-1], *c.etcd_hosts]
    return (
        f"partition {{{','.join(majority)}}} | {{{','.join(minority)}}}",
        lambda: c.net.partition(majority, minority),
        c.net.heal,
        hold,
        None,
    )


def _leader(c: JepsenCluster) -> tuple[str, list[int]]:
    """The broker leading the most partitions of TOPIC now (Metadata), and those
    partitions. None known (no leader anywhere): the controller, named for all of them,
    so that the failover bound still measures every partition."""
    leaders = c.leaders(TOPIC)
    if not leaders:
        return _controller(c), list(range(PARTITIONS))
    hosts = list(leaders.values())
    victim = max(hosts, key=lambda h: (hosts.count(h), -hosts.index(h)))
    return victim, [p for p, h in leaders.items() if h == victim]


def _past_session(c: JepsenCluster, hold: float) -> float:
    # Held past the session timeout, so that the leader's lease is gone and a failover
    # happened before the fault is undone.
    return max(hold, c.session_ms / 1000 + 3)


KILL_LEADER = "kill -9"  # how fault_kill_leader's faults are named


def fault_kill_leader(c: JepsenCluster, hold: float) -> Step:
    victim, led = _leader(c)

    def restart() -> None:
        c.restart(victim)
        c.wait_broker(victim, 60)

    return (
        f"{KILL_LEADER} {victim} (leader of {led})",
        lambda: c.kill(victim),
        restart,
        _past_session(c, hold),
        led,
    )


def fault_pause_leader(c: JepsenCluster, hold: float) -> Step:
    victim, led = _leader(c)
    hold = _past_session(c, hold)
    return (
        f"SIGSTOP {victim} (leader of {led}) {hold:.0f}s",
        lambda: c.pause(victim),
        lambda: c.resume(victim),
        hold,
        led,
    )


def fault_isolate_leader(c: JepsenCluster, hold: float) -> Step:
    victim, led = _leader(c)
    rest = [h for h in c.broker_hosts if h != victim] + c.etcd_hosts
    return (
        f"partition {{{victim}}} (leader of {led}) | {{{','.join(rest)}}}",
        lambda: c.net.partition([victim], rest),
        c.net.heal,
        _past_session(c, hold),
        led,
    )


FAULTS = {
    "kill": fault_kill,
    "pause": fault_pause,
    "isolate-controller": fault_isolate_controller,
    "majority-minority": fault_majority,
}
# Aimed at the leaders of the producers' partitions: the quorum run's faults.
LEADER_FAULTS = {
    "kill-leader": fault_kill_leader,
    "pause-leader": fault_pause_leader,
    "isolate-leader": fault_isolate_leader,
}
# How long after a fault aimed at leaders the producers may go without writing those
# partitions, past the session timeout (checker.failover_bound): the producers' request
# timeout (5 s, compat_tests/jepsen/workload.py: a request stuck at a leader cut off from
# its replicas times out before the client asks again), then 3 s for the vote, the
# takeover and the client's metadata refresh and retry. Measured: 5.2-8.3 s in the light
# runs, up to 11.0 s in the long ones, with a session timeout of 6 s.
FAILOVER_MARGIN_S = 8.0


def run(
    workdir: Path,
    schedule: list[str],
    hold: float,
    recover: float,
    session_ms: int,
    etcd_members: int = 1,
    log: Callable[[str], None] = print,
    quorum: bool = False,
) -> Report:
    """One run; `schedule` names faults of FAULTS and LEADER_FAULTS in order. With
    `quorum`, partitions are quorum-signed, and after the run every broker's copy of the
    producers' partitions is read back for the quorum checks."""
    t_begin = time.monotonic()
    cluster = JepsenCluster(
        workdir, etcd_members=etcd_members, session_ms=session_ms, quorum=quorum
    )
    clients = Clients(cluster, workdir)
    faults: list[checker.Fault] = []
    try:
        cluster.start()
        log(f"cluster up (net {cluster.net.tag}) in {time.monotonic() - t_begin:.1f}s")
        clients.once("create", "create", cluster.bootstrap(), TOPIC, str(PARTITIONS))
        clients.start()
        time.sleep(recover)  # a baseline before the first fault
        for name in schedule:
            desc, apply, undo, held, led = {**FAULTS, **LEADER_FAULTS}[name](cluster, hold)
            log(f"fault: {desc}")
            start = time.monotonic()
            apply()
            try:
                time.sleep(held)
            finally:
                undo()
            faults.append(checker.Fault(desc, start, time.monotonic(), 0.0, led))
            time.sleep(recover)
        # After the last fault, a second recovery time in which every kind of client must
        # succeed again (checker.recovered).
        recovered_at = time.monotonic()
        time.sleep(max(recover, 2 * session_ms / 1000))
        clients.stop()
        t_end = time.monotonic()
        for i, f in enumerate(faults):
            f.end = faults[i + 1].start if i + 1 < len(faults) else t_end
        final = _final_state(cluster, clients, settle=max(recover, session_ms / 1000 * 2))
    finally:
        clients.kill()
        cluster.close()

    state = {
        "recovered_at": recovered_at,
        "seconds": time.monotonic() - t_begin,
        "faults": [f.__dict__ for f in faults],
        "final": final,
        "failover_bound_s": session_ms / 1000 + FAILOVER_MARGIN_S,
        "session_s": session_ms / 1000,
    }
    if quorum:
        # The brokers stopped (cluster.close): their data dirs are read as they left them.
        data_dirs = {n: cluster.data_dir(h) for n, h in enumerate(cluster.broker_hosts, 1)}
        state["copies"] = read_copies(data_dirs, TOPIC, PARTITIONS)
    (workdir / "state.json").write_text(json.dumps(state))
    return evaluate(workdir)


INTERNAL = {"__consumer_offsets", "__transaction_state"}
Views = dict[int, dict[str, dict[int, int]] | None]


def _without(views: Views, names: set[str]) -> Views:
    return {
        b: None if v is None else {t: p for t, p in v.items() if t not in names}
        for b, v in views.items()
    }


def _only(views: Views, names: set[str]) -> Views:
    return {
        b: None if v is None else {t: p for t, p in v.items() if t in names}
        for b, v in views.items()
    }


def _ints(d: Mapping[str, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in d.items()}


def evaluate(workdir: Path) -> Report:
    """The checks over a finished run's work directory (histories and state.json), so a
    run can be checked again, e.g. after a checker fix, without running it again."""
    state = json.loads((workdir / "state.json").read_text())
    final = state["final"]
    faults = [checker.Fault(**f) for f in state["faults"]]
    records = {p: _ints(offsets) for p, offsets in _ints(final["records"]).items()}
    views: Views = {
        b: None if v is None else {t: _ints(parts) for t, parts in v.items()}
        for b, v in _ints(final["views"]).items()
    }
    sends = _history(workdir / "producer-a.jsonl") + _history(workdir / "producer-b.jsonl")
    commits = _history(workdir / "consumer.jsonl")
    probe = _history(workdir / "probe.jsonl")
    creates = _history(workdir / "admin.jsonl")
    violations = {
        "no acknowledged record lost": checker.lost_writes(sends, records),
        "no record stored twice (idempotence)": checker.duplicates(records),
        "one writer per partition": checker.two_writers(sends),
        "no committed offset lost or moved backwards (probe, to all)": checker.lost_commits(
            _of(probe, f"{PROBE_GROUP}-all"), final["probe"][f"{PROBE_GROUP}-all"]
        ),
        "no committed offset lost or moved backwards (probe, in turn)": checker.lost_commits(
            _of(probe, f"{PROBE_GROUP}-rr"), final["probe"][f"{PROBE_GROUP}-rr"]
        ),
        "no committed offset lost (consumer group)": checker.group_commits_kept(
            commits, _ints(final["group"])
        ),
        "one coordinator per group": checker.two_coordinators(_of(probe, f"{PROBE_GROUP}-all")),
        "producers recover": checker.recovered(sends, "send", state["recovered_at"], "send"),
        "groups recover": checker.recovered(commits, "commit", state["recovered_at"], "commit"),
        "admin recovers": checker.recovered(
            creates, "create", state["recovered_at"], "CreateTopics"
        ),
        "topics agree": checker.topics_agree(
            creates + _of_op(probe, "create"), _without(views, INTERNAL)
        ),
        "internal topics agree": checker.topics_agree([], _only(views, INTERNAL)),
    }
    rows = checker.unavailability(faults, sends, commits, creates)
    if any(f.partitions is not None for f in faults):
        # A killed leader's peers see its port refuse connections and revoke its lease
        # (broker/cluster/liveness.py): the producers write again within the session
        # timeout. A paused or cut off one is silence: the session timeout, then the margin.
        bound, session = state["failover_bound_s"], state["session_s"]
        killed = [f.name.startswith(KILL_LEADER) for f in faults]
        for label, limit, which in (
            (f"within the session timeout ({session:.0f} s) of a leader's kill -9", session, True),
            (f"within {bound:.0f} s of a leader paused or cut off", bound, False),
        ):
            chosen = [(f, r) for f, r, k in zip(faults, rows, killed, strict=True) if k == which]
            violations[f"producers write again {label}"] = checker.failover_bound(
                [r for _, r in chosen], [f for f, _ in chosen], limit
            )
    if "copies" in state:
        copies = state["copies"]
        violations["quorum-signed heads agree within a fork"] = checker.quorum_heads_agree(copies)
        violations["every broker's copy follows the final fork"] = checker.copies_follow_final_fork(
            copies, range(1, len(final["views"]) + 1), range(PARTITIONS)
        )
        violations["acknowledged records under a quorum head of the final fork"] = (
            checker.acked_in_final_fork(sends, copies)
        )
    counts = {
        "acked sends": sum(1 for e in sends if e.get("ok")),
        "failed sends": sum(1 for e in sends if e["op"] == "send" and not e["ok"]),
        "acked without offset": sum(1 for e in sends if e.get("ok") and e["offset"] is None),
        "acked commits": sum(1 for e in commits if e.get("ok")),
        "probe rounds": max((e.get("round", 0) for e in probe), default=0),
        "topics created": sum(1 for e in creates if e.get("ok")),
    }
    report = Report(
        state["seconds"],
        counts,
        violations,
        rows,
        [f.name for f in faults],
    )
    (workdir / "report.json").write_text(json.dumps(report.__dict__, indent=1))
    return report


def _final_state(cluster: JepsenCluster, clients: Clients, settle: float) -> dict[str, Any]:
    """After the last heal: wait until every broker answers and names one controller (or
    `settle` runs out), then read back everything the checks need."""
    deadline = time.monotonic() + settle
    while time.monotonic() < deadline and cluster.controller() is None:
        time.sleep(0.5)
    time.sleep(min(settle, 3.0))
    records: dict[int, dict[int, str]] = {}
    for e in clients.once("readall", "readall", cluster.bootstrap(), TOPIC, str(PARTITIONS)):
        if e["op"] == "read":
            records.setdefault(e["partition"], {})[e["offset"]] = e["value"]
    group = {
        e["partition"]: e["offset"]
        for e in clients.once(
            "committed", "committed", cluster.bootstrap(), TOPIC, GROUP, str(PARTITIONS)
        )
    }
    probe_final: dict[str, int | None] = {}
    for g in (f"{PROBE_GROUP}-all", f"{PROBE_GROUP}-rr"):
        probe_final[g] = None
        for e in clients.once("committed", f"committed-{g}", cluster.bootstrap(), TOPIC, g, "1"):
            probe_final[g] = e["offset"]
    views: dict[int, dict[str, dict[int, int]] | None] = {}
    for node, host in enumerate(cluster.broker_hosts, 1):
        md = cluster.metadata(host)
        views[node] = (
            {t: {p: info.leader for p, info in parts.items()} for t, parts in md.topics.items()}
            if isinstance(md, Metadata)
            else None
        )
    return {"records": records, "group": group, "probe": probe_final, "views": views}


LIGHT_SCHEDULE = ["kill", "pause", "isolate-controller", "majority-minority"]


QUORUM_LIGHT_SCHEDULE = ["kill-leader", "pause-leader", "isolate-leader"]


def long_schedule(
    seconds: float, hold: float, recover: float, seed: int, faults: Mapping[str, Any] = FAULTS
) -> list[str]:
    rng = random.Random(seed)
    n = max(1, int(seconds // (hold + recover)))
    return [rng.choice(list(faults)) for _ in range(n)]
