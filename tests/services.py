"""Real PostgreSQL and Redis servers for the shared-storage tests and benchmarks (no mocks):
the system packages' binaries (`make services` installs them), started once per process on
loopback in a temporary folder and stopped at exit. Each test gets a fresh database; a test
that needs a server that cannot start here is skipped with the reason, except in CI (the
environment variable CI set to true, as CI services set it), where it fails: a missing
server there is a broken build, not a reason to leave the shared-state tests unrun.
"""
from __future__ import annotations

import atexit
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

_servers: dict = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_binary(name: str) -> str | None:
    """On PATH, or where Debian keeps PostgreSQL's server binaries (newest version first)."""
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    return versions[-1] if versions else None


class ServiceError(RuntimeError):
    """A server could not start; the message says why."""


class Postgres:
    """A throwaway cluster. PostgreSQL refuses to run as root, so under root it runs as the
    `postgres` user the package creates (or `nobody`), in a folder that user owns."""

    def __init__(self, fsync: bool = False):
        initdb, pg_ctl = find_binary("initdb"), find_binary("pg_ctl")
        if not (initdb and pg_ctl):
            raise ServiceError("initdb/pg_ctl not found (install the postgresql package: `make services`)")
        self.root = Path(tempfile.mkdtemp(prefix="sluice-pg-"))
        self.port = free_port()
        self.pg_ctl = pg_ctl
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            user = "postgres" if _user_exists("postgres") else "nobody"
            shutil.chown(self.root, user)
            self.as_user = ["runuser", "-u", user, "--"]
        data = self.root / "data"
        self._run([initdb, "-D", str(data), "-U", "sluice", "--auth=trust", "-E", "UTF8", "--no-instructions"])
        options = (f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.root} "
                   f"-c max_connections=300 -c fsync={'on' if fsync else 'off'}")
        self._run([pg_ctl, "-D", str(data), "-l", str(self.root / "log"), "-w", "-t", "60", "-o", options, "start"])
        self.data = data
        self.url = f"postgresql://sluice@127.0.0.1:{self.port}"

    def _run(self, command: list[str]) -> None:
        done = subprocess.run(self.as_user + command, capture_output=True, text=True, cwd=self.root)
        if done.returncode:
            log = (self.root / "log").read_text() if (self.root / "log").exists() else ""
            raise ServiceError(f"{Path(command[0]).name} failed: {done.stderr.strip() or done.stdout.strip()} "
                               f"{log[-500:]}")

    def fresh_database(self) -> str:
        """The URL of a new, empty database."""
        import psycopg
        name = f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(f"{self.url}/postgres", autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return f"{self.url}/{name}"

    def restart(self) -> None:
        """Stop at once (connections drop mid-transaction, as in a crash), then start again."""
        self._run([self.pg_ctl, "-D", str(self.data), "-l", str(self.root / "log"), "-m", "immediate", "-w", "-t", "60",
                   "restart"])

    def stop(self) -> None:
        subprocess.run(self.as_user + [self.pg_ctl, "-D", str(self.data), "-m", "immediate", "stop"],
                       capture_output=True, cwd=self.root)
        shutil.rmtree(self.root, ignore_errors=True)


class Redis:
    def __init__(self):
        self.binary = find_binary("redis-server")
        if not self.binary:
            raise ServiceError("redis-server not found (install the redis-server package: `make services`)")
        self.root = Path(tempfile.mkdtemp(prefix="sluice-redis-"))
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        """Start the server (again, after `kill`: on the same port, empty)."""
        self.process = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--dir", str(self.root)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        deadline = time.monotonic() + 30
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise ServiceError(f"redis-server did not start (exit code {self.process.poll()})") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """Stop the server at once, as a crash would (what it held is gone)."""
        self.process.kill()
        self.process.wait(timeout=30)

    def fresh_database(self, db: int = 0) -> str:
        """The URL of logical database `db` (0-15), emptied."""
        import redis
        url = f"{self.url}/{db}"
        redis.Redis.from_url(url).flushdb()
        return url

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _user_exists(name: str) -> bool:
    import pwd
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def server(kind: type[Postgres] | type[Redis]):
    """This process's one server of that kind, started on first use; skips the test if it cannot
    start (fails it in CI)."""
    if kind not in _servers:
        try:
            _servers[kind] = kind()
            atexit.register(_servers[kind].stop)
        except (ServiceError, OSError) as e:
            _servers[kind] = e
    found = _servers[kind]
    if isinstance(found, Exception):
        if in_ci():
            pytest.fail(f"{kind.__name__} cannot start in CI: {found}", pytrace=False)
        pytest.skip(f"{kind.__name__} cannot start here: {found}")
    return found


@pytest.fixture
def postgres_url() -> str:
    return server(Postgres).fresh_database()


@pytest.fixture
def redis_url() -> str:
    return server(Redis).fresh_database()


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_at(request, tmp_path) -> str:
    """Where a ledger lives, for the tests that run on every database: a SQLite file, or a
    fresh PostgreSQL database."""
    return str(tmp_path / "ledger.sqlite") if request.param == "sqlite" else server(Postgres).fresh_database()
