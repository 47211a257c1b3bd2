"""The SASL credential file: salted SCRAM credentials per user, never a password.

Owns `UserStore`: a JSON file (mode 0600, replaced atomically) in the data directory
holding, per user, a SCRAM-SHA-256 and a SCRAM-SHA-512 credential (salt, iterations,
StoredKey, ServerKey). PLAIN logins are checked against those by recomputing StoredKey.
The broker re-reads the file when its mtime changes, so `hyperkafka users add` takes
effect without a restart. Imports only the standard library and `.scram`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from broker.security.scram import MECHANISMS, MIN_ITERATIONS, ScramCredential, make_credential

FILE_NAME = "sasl-users.json"
_NAME = re.compile(r"^[^\x00-\x1f,=:\s][^\x00-\x1f,:]{0,254}$")


class UserStoreError(Exception):
    """The credential file is unreadable, or a user name or password is refused."""


class UserStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._users: dict[str, dict[str, ScramCredential]] = {}
        self._stamp: tuple[int, int] | None = None

    @classmethod
    def in_data_dir(cls, data_dir: Path) -> UserStore:
        return cls(Path(data_dir) / FILE_NAME)

    def _refresh(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._users, self._stamp = {}, None
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        try:
            doc = json.loads(self.path.read_text())
            users = {
                name: {mech: ScramCredential.from_json(mech, cred) for mech, cred in mechs.items()}
                for name, mechs in doc.get("users", {}).items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserStoreError(f"{self.path.name}: unreadable credential file: {exc}") from None
        self._users, self._stamp = users, stamp

    def lookup(self, mechanism: str, username: str) -> ScramCredential | None:
        """The credential for a SCRAM mechanism; for PLAIN, the user's strongest one."""
        self._refresh()
        creds = self._users.get(username)
        if not creds:
            return None
        if mechanism in MECHANISMS:
            return creds.get(mechanism)
        return creds.get("SCRAM-SHA-512") or creds.get("SCRAM-SHA-256")

    def names(self) -> list[str]:
        self._refresh()
        return sorted(self._users)

    def mechanisms(self, username: str) -> list[str]:
        self._refresh()
        return sorted(self._users.get(username, {}))

    def add(self, username: str, password: str, iterations: int = MIN_ITERATIONS, mechanisms: tuple[str, ...] = tuple(MECHANISMS)) -> None:
        if not _NAME.match(username):
            raise UserStoreError(f"refusing user name {username!r}: no control characters, commas, colons or spaces")
        if not password:
            raise UserStoreError("refusing an empty password")
        creds = {m: make_credential(m, password, iterations) for m in mechanisms}
        with self._writing():
            self._refresh()
            self._users[username] = creds
            self._save()

    def remove(self, username: str) -> bool:
        with self._writing():
            self._refresh()
            if self._users.pop(username, None) is None:
                return False
            self._save()
            return True

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Serialise writers of the file (two `users add` at once would each write back
        what they read, losing the other's user). Not the data dir's broker lock: the
        broker only reads this file, and `users add` is meant to run beside it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(self.path) + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._stamp = None  # re-read what another writer may have saved meanwhile
            yield
        finally:
            os.close(fd)

    def _save(self) -> None:
        doc = {
            "version": 1,
            "users": {name: {m: c.to_json() for m, c in creds.items()} for name, creds in sorted(self._users.items())},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # mkstemp creates the file 0600; rename makes the switch atomic for the broker.
        fd, tmp = tempfile.mkstemp(prefix=".sasl-users-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._stamp = None
