"""What every benchmark shares: the repository on sys.path, the machine's memory bandwidth,
timing, percentiles, and where results go."""
from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memory_bandwidth_gbs() -> float:
    """Read bandwidth: summing a 1 GiB float32 tensor, best of five."""
    x = torch.ones(2**28)
    x.sum()
    return x.numel() * 4 / min(timed(x.sum) for _ in range(5)) / 1e9


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__}
