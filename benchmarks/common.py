"""What every benchmark shares: the repository on sys.path, the machine's memory bandwidth,
timing, percentiles, a `sluice serve` process, and where results go."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memory_bandwidth_gbs(repeats: int = 5) -> float:
    """Read bandwidth: summing a 1 GiB float32 tensor, best of `repeats`."""
    x = torch.ones(2**28)
    x.sum()
    return x.numel() * 4 / min(timed(x.sum) for _ in range(repeats)) / 1e9


def write_results(path: Path, results: dict) -> None:
    """The benchmark's JSON at `path` (its folder made on the way), and a line saying so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def resident_mb(pid: int) -> float:
    """The process's resident memory (VmRSS), MB."""
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


def machine() -> dict:
    # The vector ISA torch dispatches to: quantized ops' speed, and which path wins, differ by it;
    # and the core (family and model), as cores of one ISA differ too: Zen 1 runs AVX2 on 128-bit
    # units, Zen 3 on 256-bit ones, which turns which precision is faster (docs/engine.md).
    return {"cpu": platform.processor() or platform.machine(), "core": core(),
            "isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def core() -> str:
    """The CPU's model name, family and model from /proc/cpuinfo ("" where there is none)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info.split("\n\n")[0].splitlines())}
    return f"{field.get('model name', '')} (family {field.get('cpu family', '?')}, model {field.get('model', '?')})"


@dataclass(frozen=True)
class Running:
    url: str
    pid: int


@contextmanager
def sluice_server(args: list[str], log: Path, env: dict[str, str] | None = None,
                  timeout: float = 300) -> Iterator[Running]:
    """`sluice <args> --port P` in its own process on 127.0.0.1, its stderr in `log`; yields
    its URL and process id once /readyz answers 200, and stops it afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "cli", *args, "--port", str(port)]
    server = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                              stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield Running(url, server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)


def smollm_setup(folder: Path, keys: dict[str, str], output_tokens: int, server: str = "") -> list[str]:
    """A `sluice serve` setup in `folder`: SmolLM2-135M (the `smollm2-135m` store model) as its one
    model, a tenant per (name, API key) whose limits never bind, `server` more lines at the top of
    the server config. Returns the CLI arguments."""
    (folder / "tenants").mkdir()
    for name, key in keys.items():
        (folder / "tenants" / f"{name}.toml").write_text(f"""
api_key_sha256 = ["{hashlib.sha256(key.encode()).hexdigest()}"]
allowed_models = ["small"]
default_model = "small"
context_budget = 400
output_budget = {output_tokens}
prefix_cache_salt = "salt-{name}"
[limits]
requests_per_minute = 100000000
tokens_per_minute = 100000000
monthly_spend_cap_usd = 1000000.0
""")
    (folder / "server.toml").write_text(f"""{server}
[engine]
memory_budget_gb = 2.0
[engine.models.small]
source = "smollm2-135m"
[prices.small]
input = 0.1
cached_input = 0.025
output = 0.4
""")
    return ["--config", str(folder / "server.toml"), "serve", "--tenants", str(folder / "tenants"),
            "--data", str(folder / "data")]
