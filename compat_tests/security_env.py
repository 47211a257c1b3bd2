"""Test-time PKI and secured brokers for compat_tests/test_security.py.

Owns: a throwaway CA, a server certificate for 127.0.0.1/localhost and client
certificates, all made with the openssl CLI in a temporary directory at test time (never
committed); the properties file of a broker with several listeners; SASL users added
through `python -m broker users add --password-stdin`, as an operator would.
Imports the standard library and compat_tests.harness only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from compat_tests import harness
from compat_tests.harness import Broker


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca: Path  # CA certificate (PEM): the clients' trust store
    server: Path  # certificate chain + key (PEM): the broker's keystore
    client_cert: Path  # CN=writer,O=hk-test, signed by the CA
    client_key: Path
    stranger_cert: Path  # a self-signed client certificate the broker must refuse
    stranger_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(where: Path) -> Pki:
    if shutil.which("openssl") is None:
        harness.require(False, "the openssl CLI is needed to make test certificates")
    where.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=hk-test-ca", cwd=where)
    (where / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    (where / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subj, ext in (("server", "/CN=localhost", "server.ext"), ("client", "/O=hk-test/CN=writer", "client.ext")):
        _openssl("req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subj, cwd=where)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", ext, cwd=where)
    _openssl("req", "-x509", *ec, "-keyout", "stranger.key", "-out", "stranger.crt", "-days", "2", "-subj", "/CN=stranger", cwd=where)
    server_pem = where / "server.pem"
    server_pem.write_bytes((where / "server.crt").read_bytes() + (where / "ca.pem").read_bytes() + (where / "server.key").read_bytes())
    return Pki(where, where / "ca.pem", server_pem, where / "client.crt", where / "client.key", where / "stranger.crt", where / "stranger.key")


@dataclass
class SecureBroker:
    broker: Broker
    ports: dict[str, int]  # listener name -> port
    pki: Pki

    def bootstrap(self, listener: str) -> str:
        return f"127.0.0.1:{self.ports[listener]}"


LISTENERS = ("PLAINTEXT", "SSL", "MTLS", "SASL_PLAINTEXT", "SASL_SSL")
USERS = {"writer": "writer-secret", "reader": "reader-secret", "admin": "admin-secret"}


def add_user(data_dir: Path, name: str, password: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(harness.ROOT)
    subprocess.run(
        [sys.executable, "-m", "broker", "users", "--data-dir", str(data_dir), "add", name, "--password-stdin"],
        input=(password + "\n").encode(),
        check=True,
        capture_output=True,
        timeout=60,
        cwd=harness.ROOT,
        env=env,
    )


@contextlib.contextmanager
def secure_broker(workdir: Path, pki: Pki, extra_props: dict[str, str] | None = None) -> Iterator[SecureBroker]:
    """A started broker with one listener of every kind; the PLAINTEXT one is what the
    harness probes. It must still run, and exit 0 on SIGTERM, when the with-block ends."""
    ports = {name: harness.free_port() for name in LISTENERS}
    data_dir = workdir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, password in USERS.items():
        add_user(data_dir, name, password)
    props = {
        "listeners": ",".join(f"{n}://127.0.0.1:{p}" for n, p in ports.items()),
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,SSL:SSL,MTLS:SSL,SASL_PLAINTEXT:SASL_PLAINTEXT,SASL_SSL:SASL_SSL",
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(pki.server),
        "ssl.truststore.location": str(pki.ca),
        "listener.name.mtls.ssl.client.auth": "required",
        "sasl.enabled.mechanisms": "PLAIN,SCRAM-SHA-256,SCRAM-SHA-512",
        "super.users": "User:admin",
        # Writers: the SASL user "writer" and the holder of the client certificate.
        "hyperkafka.acl.topic.*.write+create": "User:writer;User:CN=writer,O=hk-test",
        "hyperkafka.acl.topic.private-*.read": "User:writer;User:reader",
    }
    props.update(extra_props or {})
    with harness.configured_broker(
        workdir, props, data_dir=data_dir, port=ports["PLAINTEXT"], what="the security tests"
    ) as b:
        yield SecureBroker(b, ports, pki)
