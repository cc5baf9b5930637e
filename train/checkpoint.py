"""Checkpoints: one file per run, written atomically (write to a temporary file, fsync, rename)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

CHECKPOINT_NAME = "checkpoint.pt"


def rng_state() -> dict:
    """The global random states a run depends on (python, numpy, torch CPU, and CUDA where present)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str | Path, state: dict) -> Path:
    """Write `state` (anything torch.save takes) to run_dir/checkpoint.pt atomically.

    A crash at any point leaves either the previous complete checkpoint or the new one, never a torn file.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / CHECKPOINT_NAME
    tmp = run_dir / (CHECKPOINT_NAME + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(run_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def load_checkpoint(run_dir: str | Path) -> dict:
    path = Path(run_dir) / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return torch.load(path, map_location="cpu", weights_only=False)


def policy_state(policy: torch.nn.Module) -> dict:
    """What a checkpoint keeps of the policy: its trainable tensors when some are frozen (LoRA: the adapters
    only; the frozen base is rebuilt from the model it came from), else the whole state dict."""
    if all(p.requires_grad for p in policy.parameters()):
        return policy.state_dict()
    return {name: p.detach() for name, p in policy.named_parameters() if p.requires_grad}


def load_policy_state(policy: torch.nn.Module, state: dict) -> None:
    """Load `policy_state` output back; every trainable tensor must be in it, and nothing unknown."""
    missing, unexpected = policy.load_state_dict(state, strict=False)
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    lost = sorted(trainable & set(missing))
    if lost or unexpected:
        raise ValueError(
            f"checkpoint does not match the policy: missing {lost[:3]}, unexpected {sorted(unexpected)[:3]}"
        )
