"""What the benchmarks share: a mean with its 95% confidence interval over seeds, the machine a figure was
measured on, interleaved timing and peak-memory measurement."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

# two-sided 95% Student t quantiles by degrees of freedom (2.0 stands in above 15: within 0.13 of the truth)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}
_T95 |= {11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13}


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% Student t interval) of at least two values, e.g. paired gaps by seed."""
    if len(values) < 2:
        raise ValueError(f"a confidence interval needs at least two values, got {len(values)}")
    half = _T95.get(len(values) - 1, 2.0) * statistics.stdev(values) / len(values) ** 0.5
    return statistics.mean(values), half


def machine() -> dict:
    """What a CPU figure depends on: the CPU model, its cores and whether it multiplies bf16 natively (AMX or
    AVX-512 BF16; without either, torch emulates bf16 matmuls several times slower than fp32)."""
    import os
    import platform

    import torch

    flags, model = set(), platform.processor()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    return dict(
        cpu=model,
        cpus=os.cpu_count(),
        native_bf16=sorted(flags & {"amx_bf16", "avx512_bf16"}),
        avx512=("avx512f" in flags),
        torch=torch.__version__,
    )


def interleaved_times(runs: dict, reps: int, setup=None, sync=None) -> dict[str, list[float]]:
    """Each callable of ``runs`` timed round-robin (machine noise hits them alike): one warm-up round, then
    ``reps`` timed rounds. ``setup(name)``, when given, runs untimed before each call; ``sync()`` (a device
    synchronisation) after each call, before the clock is read."""
    times = {name: [] for name in runs}
    for rep in range(reps + 1):  # the first round is a warm-up
        for name, run in runs.items():
            if setup is not None:
                setup(name)
            t0 = time.perf_counter()
            run()
            if sync is not None:
                sync()
            if rep:
                times[name].append(time.perf_counter() - t0)
    return times


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_growth_mib(call) -> tuple[float, float]:
    """(peak RSS growth in MiB, seconds) of one ``call()`` (Linux). torch's CPU allocator keeps no peak of its
    own, so the process's peak resident set (VmHWM) is reset to the current one first, then read."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    call()
    seconds = time.perf_counter() - t0
    return (_status_kib("VmHWM") - base) / 1024.0, seconds


def merge_json(path: Path, key: str, value) -> None:
    """Write ``value`` under ``key`` in the JSON object at ``path``, keeping its other keys (results merged
    by shape, one run at a time)."""
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
