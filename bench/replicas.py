"""A deployment on loopback: redis-server, N replicas of `python -m app` and nginx, started and
stopped together (the replica test, tests/test_replicas.py, and `python -m bench.load --replicas`).

    with Deployment(run_dir, replicas=2, model="tiny") as d:
        d.http, d.ws                 # nginx: the balancer every reader goes through
        d.replica_urls["1"]          # a replica directly (its /healthz)

Debian's binaries (`nginx`, `redis-server`; `make test` installs them) run in the foreground
as children of this process on free loopback ports, with every file they write under run_dir
(nginx.conf from app/replicas.py). With replicas=1 and balanced=False it is one server alone, as
`python -m app` serves today: no Redis, no nginx. Each replica gets its replica_id, the Redis
URL, the balancer as its trusted proxy, and its own rooms file.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 600       # hang-stopping only: a first start may build the C++ decoder


def find_binary(name: str) -> str | None:
    """A Debian binary: on PATH, or in /usr/sbin (nginx, for a user whose PATH lacks it)."""
    found = shutil.which(name)
    if found:
        return found
    for folder in ("/usr/sbin", "/usr/bin", "/sbin"):
        if os.access(f"{folder}/{name}", os.X_OK):
            return f"{folder}/{name}"
    return None


def missing_binaries() -> list[str]:
    return [name for name in ("nginx", "redis-server") if find_binary(name) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


def wait_until(check, proc, what: str, log: Path, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        try:
            if check():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start in {timeout:.0f} s:\n{_tail(log)}")
        time.sleep(0.2)


def stop_process(proc, sig=signal.SIGTERM, timeout: float = 30) -> None:
    """Ask a process to end with `sig`; kill it if it has not ended in `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-3000:]
    except OSError:
        return "(no log)"


class Deployment:
    def __init__(self, run_dir, replicas: int = 2, model: str = "tiny", settings: dict | None = None,
                 balanced: bool = True):
        """settings: more `--setting NAME VALUE` for every replica. balanced=False: no Redis and no
        nginx (only with one replica: a server alone)."""
        if not balanced and replicas != 1:
            raise ValueError("replicas: without the balancer there is one server")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.count, self.model, self.settings, self.balanced = replicas, model, dict(settings or {}), balanced
        self.procs: list[tuple[str, subprocess.Popen, object]] = []
        self.replica_urls: dict[str, str] = {}
        self.redis_url = ""

    # -- the parts ------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env=None) -> tuple[subprocess.Popen, Path]:
        log_path = self.run_dir / f"{name}.log"
        log = open(log_path, "w")
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        self.procs.append((name, proc, log))
        return proc, log_path

    def _start_redis(self) -> None:
        port = free_port()
        proc, log = self._spawn("redis", [find_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                                          "--save", "", "--appendonly", "no", "--dir", str(self.run_dir),
                                          "--daemonize", "no"])
        self.redis_url = f"redis://127.0.0.1:{port}/0"

        def answers():
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        wait_until(answers, proc, "redis-server", log, timeout=60)

    def _start_replica(self, rid: str) -> None:
        port = free_port()
        settings = {**self.settings, "rooms_db_path": str(self.run_dir / f"rooms-{rid or 'alone'}.sqlite3")}
        if self.balanced:
            settings.update(replica_id=rid, redis_url=self.redis_url, trusted_proxies="127.0.0.1")
        argv = [sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(port), "--model", self.model]
        for name, value in settings.items():
            argv += ["--setting", name, str(value)]
        from app.config import ENV_PREFIX, settings
        ours = {ENV_PREFIX + name.upper() for name in settings()}   # settings come from argv only (SENDLENS_CACHE stays)
        env = {k: v for k, v in os.environ.items() if k not in ours}
        env.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
        proc, log = self._spawn(f"replica-{rid or 'alone'}", argv, env)
        self.replica_urls[rid] = f"http://127.0.0.1:{port}"
        self._waiting.append((proc, log, self.replica_urls[rid]))

    def _start_nginx(self) -> None:
        from app.replicas import standalone
        port = free_port()
        upstreams = {rid: url.removeprefix("http://") for rid, url in self.replica_urls.items()}
        conf = self.run_dir / "nginx.conf"
        conf.write_text(standalone(f"127.0.0.1:{port}", upstreams, str(self.run_dir)))
        proc, log = self._spawn("nginx", [find_binary("nginx"), "-p", str(self.run_dir), "-c", str(conf),
                                          "-e", str(self.run_dir / "error.log")])
        self.http = f"http://127.0.0.1:{port}"
        wait_until(lambda: get_json(self.http + "/healthz")["status"] == "ok", proc, "nginx", log, timeout=60)

    # -- the whole ------------------------------------------------------------------------------
    def start(self) -> "Deployment":
        missing = missing_binaries() if self.balanced else []
        if missing:
            raise RuntimeError(f"not installed: {', '.join(missing)} (Debian's packages; make test installs them)")
        try:
            if self.balanced:
                self._start_redis()
            self._waiting = []
            for i in range(self.count):
                self._start_replica(str(i + 1) if self.balanced else "")
            for proc, log, url in self._waiting:      # the replicas start side by side
                wait_until(lambda: get_json(url + "/healthz")["status"] == "ok", proc, f"the replica at {url}", log)
            if self.balanced:
                self._start_nginx()
            else:
                self.http = next(iter(self.replica_urls.values()))
            self.ws = self.http.replace("http://", "ws://") + "/ws"
        except BaseException:
            self.stop()
            raise
        return self

    def health(self) -> dict[str, dict]:
        """Each replica's /healthz, by replica id."""
        return {rid: get_json(url + "/healthz") for rid, url in self.replica_urls.items()}

    def stop(self) -> None:
        """nginx, then the replicas (SIGTERM: they close their sockets and their Redis lease),
        then Redis; each killed if it does not end in time."""
        for name, proc, log in reversed(self.procs):
            stop_process(proc, signal.SIGQUIT if name == "nginx" else signal.SIGTERM)
            log.close()
        self.procs.clear()

    def __enter__(self) -> "Deployment":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
