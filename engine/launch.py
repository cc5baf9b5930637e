"""`bitrl train --nproc N`: N local ranks under torchrun, each running `python -m bitrl train ...`.

Plain `torchrun --nproc-per-node N -m bitrl train ...` is the same thing started by hand; either way every
rank finds its place in torchrun's environment (bitrl.train.distributed.init_distributed).
"""

from __future__ import annotations

import os
import subprocess
import sys


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ


def torchrun_command(nproc: int, train_args: list[str]) -> list[str]:
    """The torchrun command line that runs `bitrl train *train_args` on `nproc` local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # one machine: a free rendezvous port, no master address to set
        f"--nproc-per-node={nproc}",
        "-m",
        "bitrl",
        "train",
        *train_args,
    ]


def without_nproc(train_args: list[str]) -> list[str]:
    """train_args less `--nproc N` / `--nproc=N` (torchrun would take `--nproc` for an option of its own)."""
    out, skip = [], False
    for arg in train_args:
        if skip or arg.startswith("--nproc="):
            skip = False
        elif arg == "--nproc":
            skip = True
        else:
            out.append(arg)
    return out


def launch(nproc: int, train_args: list[str]) -> int:
    """Run the ranks to completion; returns torchrun's exit status (non-zero when any rank failed)."""
    return subprocess.call(torchrun_command(nproc, without_nproc(train_args)))
