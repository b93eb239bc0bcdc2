"""A Postgres cluster of a test's own: initdb (the system's Postgres or
pgserver's) with scram-sha-256 and a password, optionally TLS with a
certificate of a throwaway CA, started on a free loopback port and stopped
at the end."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import LocalCA, make_ca


def postgres_bin() -> Path | None:
    """A folder with initdb and pg_ctl: on PATH, the system's Postgres, else pgserver's."""
    found = shutil.which("initdb")
    candidates = [Path(found).parent] if found else []
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs: XDG_RUNTIME_DIR unset in containers
        from pgserver._commands import POSTGRES_BIN_PATH  # the embedded Postgres ships them

        candidates.append(Path(POSTGRES_BIN_PATH))
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "pg_ctl").is_file():
            return folder
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class Cluster:
    port: int
    password: str
    ca: LocalCA | None  # with TLS: the CA that signed the server's certificate

    def url(self, database: str = "postgres", password: str | None = None) -> str:
        auth = f"postgres:{password}" if password is not None else "postgres"
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"


@contextlib.contextmanager
def cluster(password: str, *, tls: bool = False) -> Iterator[Cluster]:
    """Skips the test when this machine has no initdb, or runs as root
    without a postgres user to run it as (Postgres refuses root)."""
    folder = postgres_bin()
    if folder is None:
        pytest.skip("no initdb/pg_ctl on this machine (a Postgres or the pgserver package)")
    user = None
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no postgres user to run initdb as")
    # Not under pytest's temporary root: it is private to this user (0700), and
    # a second pytest run on the machine resets its permissions.
    root = Path(tempfile.mkdtemp(prefix="outbox-test-pg-"))

    def own(path: Path) -> None:
        if user is not None:
            os.chown(path, user.pw_uid, user.pw_gid)

    own(root)
    pwfile = root / "pwfile"
    pwfile.write_text(password + "\n")
    own(pwfile)
    data, port = root / "data", free_port()

    def run(*args: str) -> None:
        subprocess.run(
            args, check=True, capture_output=True, timeout=120, user=user.pw_uid if user else None
        )

    run(
        str(folder / "initdb"),
        "-D",
        str(data),
        "-U",
        "postgres",
        "--auth=scram-sha-256",
        f"--pwfile={pwfile}",
        "--no-sync",
        "-E",
        "UTF8",
    )
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off"
    ca = None
    if tls:
        ca = make_ca(root, names=("localhost", "127.0.0.1"))
        for path in (ca.cert_file, ca.key_file):
            own(path)
        ca.key_file.chmod(0o600)
        options += f" -c ssl=on -c ssl_cert_file={ca.cert_file} -c ssl_key_file={ca.key_file}"
    run(
        str(folder / "pg_ctl"),
        "-D",
        str(data),
        "-o",
        options,
        "-l",
        str(root / "log"),
        "-w",
        "start",
    )
    try:
        yield Cluster(port, password, ca)
    finally:
        run(str(folder / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)
