"""What a recording names besides its messages: the machine that computed it (CPU model and the
engine's threads), the engine's version (the package's and the git commit, where there is one) and
the model; and the page's source config, the JSON a page carries in <script id="sendlens-source">
(static/js/source.js reads it)."""

import functools
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "an unknown CPU"


def machine(num_threads: int | None = None) -> dict:
    """The CPU and the most threads the engine computes with (its num_threads, else one per core it
    may run on: core/cpu_share.py)."""
    from core.cpu_share import cpus_we_may_use
    return {"cpu": cpu_model(), "threads": num_threads or len(cpus_we_may_use())}


@functools.cache
def engine() -> dict:
    from importlib import metadata
    try:
        version = metadata.version("sendlens")
    except metadata.PackageNotFoundError:
        import tomllib
        version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True)
        commit = out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"version": version, "commit": commit}


def now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def page_source(model: str, num_threads: int | None, recordings_url: str | None) -> dict:
    """The live site's source config: what a live widget's kept result is recorded with, and where
    the server's recordings are (None: it serves none)."""
    return {"mode": "live", "machine": machine(num_threads), "engine": engine(), "model": model,
            "recordings": recordings_url}


def export_source(recordings_url: str, server: str | None) -> dict:
    """A static export's source config: its recordings, relative to the page, and the live server
    "Run it live" uses (None: no button)."""
    return {"mode": "export", "recordings": recordings_url, "server": server}
