"""A Docker engine and compose command for compat_tests/test_docker.py.

Owns `docker_engine()`: the environment of an engine that answers `docker version`. An
engine already running (DOCKER_HOST or the default socket) is used and left alone.
Otherwise, as root, Debian's docker.io is installed when dockerd is missing and a private
dockerd is started: its socket, exec root and pidfile in a temp dir, its data root in
HK_DOCKER_DATA (default compat_tests/.tools/docker, git-ignored) so that the base image
and the build cache survive between runs. That dockerd is stopped (SIGTERM to its pid; it
stops its own containerd), its temp dir removed and the bridge docker0 it made deleted
when the context ends (its iptables chains stay, as after any dockerd).

Also `compose_command()`: `docker compose` (v2) where it works, else `docker-compose`
(Debian's 1.x, installed as root when missing).

Imports the standard library and compat_tests.harness only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from compat_tests.harness import ROOT


class EngineUnavailable(Exception):
    """No Docker engine answers and none can be started here (not root, no apt)."""


def engine_answers(env: dict[str, str]) -> bool:
    if shutil.which("docker", path=env.get("PATH")) is None:
        return False
    proc = subprocess.run(["docker", "version"], env=env, capture_output=True, timeout=30)
    return proc.returncode == 0


def apt_install(*packages: str) -> None:
    """Install Debian packages (root only), waiting for another apt to release its lock."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise EngineUnavailable(f"need root and apt-get to install {' '.join(packages)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "-y", "-qq"]
    if subprocess.run([*apt, "install", *packages], env=env, capture_output=True).returncode == 0:
        return
    subprocess.run([*apt, "update"], env=env, capture_output=True, check=True)
    subprocess.run([*apt, "install", *packages], env=env, capture_output=True, check=True)


@contextlib.contextmanager
def docker_engine() -> Iterator[dict[str, str]]:
    env = dict(os.environ)
    if engine_answers(env):
        yield env
        return
    if os.geteuid() != 0:
        raise EngineUnavailable("no Docker engine answers and only root can start one")
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        apt_install("docker.io")
    data = Path(os.environ.get("HK_DOCKER_DATA", ROOT / "compat_tests" / ".tools" / "docker"))
    data.mkdir(parents=True, exist_ok=True)
    # dockerd makes the bridge docker0 and leaves it behind when it stops: remove it then,
    # unless it was there before (another engine's).
    had_bridge = Path("/sys/class/net/docker0").exists()
    run = Path(tempfile.mkdtemp(prefix="hk-dockerd-"))
    env["DOCKER_HOST"] = f"unix://{run}/docker.sock"
    with (run / "dockerd.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                "dockerd",
                "--data-root",
                str(data),
                "--exec-root",
                str(run / "exec"),
                "--pidfile",
                str(run / "dockerd.pid"),
                "--host",
                env["DOCKER_HOST"],
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 90
        while not engine_answers(env):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (run / "dockerd.log").read_text(errors="replace")[-3000:]
                raise EngineUnavailable(f"dockerd did not start:\n{tail}")
            time.sleep(0.5)
        yield env
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(run, ignore_errors=True)
        if not had_bridge and Path("/sys/class/net/docker0").exists():
            subprocess.run(["ip", "link", "delete", "docker0"], capture_output=True)


def compose_command(env: dict[str, str]) -> list[str]:
    if (
        subprocess.run(["docker", "compose", "version"], env=env, capture_output=True).returncode
        == 0
    ):
        return ["docker", "compose"]
    if shutil.which("docker-compose") is None:
        apt_install("docker-compose")
    return ["docker-compose"]
