"""Checkpoints: one file per run, written atomically (write to a temporary file, fsync, rename)."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

CHECKPOINT_NAME = "checkpoint.pt"


def rng_state() -> dict:
    """The global random states a run depends on (python, numpy, torch CPU, and, where CUDA is initialised,
    this process's current GPU: a rank touches its own device only; reading every GPU's state would create a
    context on each of them in every rank)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        # checkpoints written before one state per rank hold a list (one per GPU): take this rank's
        cuda = cuda[torch.cuda.current_device()] if isinstance(cuda, list | tuple) else cuda
        torch.cuda.set_rng_state(cuda)


def save_checkpoint(run_dir: str | Path, state: dict) -> Path:
    """Write `state` (anything torch.save takes) to run_dir/checkpoint.pt atomically.

    A crash at any point leaves either the previous complete checkpoint or the new one, never a torn file.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / CHECKPOINT_NAME
    _atomic_write(final, lambda f: torch.save(state, f))
    return final


def _atomic_write(final: Path, write) -> None:
    """write(f) into final + ".tmp", fsync it, rename it over `final`, fsync the directory."""
    tmp = final.with_name(final.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def _fsync_dir(path: Path) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(run_dir: str | Path) -> dict:
    path = Path(run_dir) / CHECKPOINT_NAME
    if not path.is_file():
        check_resume_world_size(Path(run_dir), world_size=1)
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


# ---------------------------------------------------------------------------------------------------------
# Sharded checkpoints of data-parallel runs (bitrl.train.distributed): one directory per checkpoint, holding
# the policy's and optimizer's shards (torch.distributed.checkpoint) and one small file per rank with its
# own state (random generators, ...). checkpoint.json names the current directory; rewriting it atomically
# is the commit point, so a crash (or a killed rank) leaves the previous checkpoint whole.

SHARDED_POINTER = "checkpoint.json"


def _sharded_options():
    """Frozen parameters (a LoRA base) are left out, as `policy_state` does for one-file checkpoints."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True)


def save_sharded_checkpoint(
    run_dir: str | Path, step: int, model: torch.nn.Module, optimizer, rank_state: dict
) -> Path:
    """Called by every rank. model: the FSDP2-sharded policy; rank_state: this rank's own state (anything
    torch.save takes). Returns the checkpoint directory."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run_dir = Path(run_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    final = run_dir / f"checkpoint-{step:07d}"
    tmp = run_dir / (final.name + ".tmp")
    model_state, optim_state = get_state_dict(model, optimizer, options=_sharded_options())
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)  # fsyncs each file
    _atomic_write(tmp / f"rank{rank}.pt", lambda f: torch.save(rank_state, f))
    dist.barrier()
    if rank == 0:
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(run_dir)
        pointer = {"dir": final.name, "step": step, "world_size": world}
        _atomic_write(run_dir / SHARDED_POINTER, lambda f: f.write(json.dumps(pointer).encode()))
        for old in run_dir.glob("checkpoint-*"):
            if old.name != final.name:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_sharded_checkpoint(run_dir: str | Path, model: torch.nn.Module, optimizer) -> dict:
    """Load the current sharded checkpoint into `model` and `optimizer` in place (same world size as when
    it was saved); returns this rank's own state."""

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    run_dir = Path(run_dir)
    if not (run_dir / SHARDED_POINTER).is_file():
        raise FileNotFoundError(f"no sharded checkpoint at {run_dir} (no {SHARDED_POINTER})")
    pointer = check_resume_world_size(run_dir, dist.get_world_size())
    path = run_dir / pointer["dir"]
    model_state, optim_state = get_state_dict(model, optimizer, options=_sharded_options())
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_sharded_options(),
    )
    return torch.load(path / f"rank{dist.get_rank()}.pt", map_location="cpu", weights_only=False)


def check_resume_world_size(run_dir: Path, world_size: int) -> dict | None:
    """The sharded checkpoint's pointer (None for a one-process checkpoint); a ValueError naming --nproc if
    it was saved by another world size."""
    pointer_path = run_dir / SHARDED_POINTER
    pointer = json.loads(pointer_path.read_text()) if pointer_path.is_file() else None
    if pointer is not None and pointer["world_size"] != world_size:
        raise ValueError(
            f"{run_dir} was saved by {pointer['world_size']} ranks; resume it with --nproc "
            f"{pointer['world_size']} (this run has {world_size})"
        )
    return pointer
