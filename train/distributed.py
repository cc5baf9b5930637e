"""Data-parallel scale-out on torch.distributed: FSDP2 for the policy, whole GRPO groups per rank.

One process per device (launched by torchrun; `bitrl train --nproc N` spawns it). Every rank holds:

* a shard of the policy, its gradients and its optimizer states (`fully_shard` per decoder layer, then the
  root; the root keeps the embeddings, the final norm and the LM head);
* a full rollout copy in its own precision, refreshed after each update one FSDP unit at a time
  (`sync_rollout_model_sharded_`): the sync never holds more than one gathered unit at full precision;
* its share of the step's prompts: whole GRPO groups (`rank_groups`), so advantages need no communication.

Loss normalisers are global (`global_counts`) and FSDP sums gradients instead of averaging them, so one
step at world size N equals one step at world size 1 on the same global batch. Outside torchrun (or at world
size 1) every helper here is the identity and the plain single-process path runs unchanged.

Where a whole model does exist per rank: the policy is built whole and sharded afterwards (a transient of one
model before the optimizer states exist), and evaluation gathers it for its duration (`gathered`), since the
rollout engine reads weights directly rather than through the model's forward.
"""

from __future__ import annotations

import atexit
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: rank, world size and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> DistContext:
    """Join torchrun's process group (nccl on CUDA, gloo on CPU); world size 1 outside torchrun.

    device: the configured device; on CUDA each rank takes cuda:LOCAL_RANK.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistContext(0, 1, 0, device)
    local_rank = int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(leave_process_group)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def leave_process_group() -> None:
    """Run at exit. A gloo worker thread drops its last collective's tensors after the collective returned,
    and that takes the GIL: if the interpreter's teardown has begun by then, the thread is cancelled inside a
    C++ destructor and the process aborts ("terminate called without an active exception"), a clean run
    failing. So the group is left, and the GIL released for a moment, before the teardown."""
    if dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(0.05)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def comm_device() -> torch.device:
    """Where collectives take their tensors: the rank's GPU under nccl, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------- rollouts


def rank_groups(
    num_groups: int, rank: int, world_size: int, group_size: int = 1, minibatches: int = 1
) -> range:
    """The GRPO groups (prompt indices) this rank generates and trains on: one contiguous block, so the global
    batch is the ranks' rows concatenated in rank order and a group never straddles two ranks. On more than
    one rank, the rank's rows (groups x group_size) must also divide by `minibatches`: the trainer's k-th
    minibatch is every minibatches-th row, and only then is the union of the ranks' k-th minibatches the
    single-process one."""
    if num_groups % world_size:
        raise ValueError(
            f"rollout.prompts_per_step ({num_groups}) must divide by the world size ({world_size}): "
            "every rank takes the same number of whole groups"
        )
    share = num_groups // world_size
    if world_size > 1 and (share * group_size) % minibatches:
        raise ValueError(
            f"train.minibatches ({minibatches}) must divide each rank's rows ({share} groups x {group_size} "
            f"samples at world size {world_size}), or the minibatches differ from a single process's"
        )
    return range(rank * share, (rank + 1) * share)


def sample_ids(groups: range, group_size: int) -> torch.Tensor:
    """Global ids of the samples of `groups` ([len(groups) * group_size] int64): sample i of group g is
    g * group_size + i, whatever the world size, so a sample's random stream does not depend on its rank."""
    return torch.arange(groups.start * group_size, groups.stop * group_size, dtype=torch.long)


def gather_rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Concatenate each [B_local, ...] tensor over ranks in rank order (equal shapes on every rank)."""
    if not is_distributed():
        return tensors
    out = []
    for t in tensors:
        local = t.to(comm_device()).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        out.append(torch.cat(parts).to(t.device))
    return tuple(out)


def pad_to_global_width(rollout, pad_id: int):
    """Right-pad the responses to the longest response over all ranks, so token-level tensors have the same
    width on every rank (and the width-dependent normalisers, e.g. Dr.GRPO's B * T, match world size 1)."""
    if not is_distributed():
        return rollout
    width = torch.tensor(rollout.response_ids.shape[1], device=rollout.response_ids.device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    extra = int(width) - rollout.response_ids.shape[1]
    if extra == 0:
        return rollout
    pad = lambda t, value: torch.nn.functional.pad(t, (0, extra), value=value)
    return type(rollout)(
        prompt_ids=rollout.prompt_ids,
        prompt_mask=rollout.prompt_mask,
        response_ids=pad(rollout.response_ids, pad_id),
        response_mask=pad(rollout.response_mask, False),
        logprobs=pad(rollout.logprobs, 0.0),
    )


# -------------------------------------------------------------------------------------- loss and metrics


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """t summed over the ranks when data-parallel (a new tensor; t itself when not)."""
    if not is_distributed():
        return t
    t = t.to(comm_device(), copy=True)
    dist.all_reduce(t)
    return t


def global_counts(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, sequences) of a [B, T] bool mask as fp32 scalars, summed over ranks when data-parallel: the
    loss normalisers that make the ranks' gradients add up to the global batch's."""
    counts = torch.stack([mask.sum(), torch.tensor(mask.shape[0], device=mask.device)]).float()
    if is_distributed():
        dist.all_reduce(counts)
    return counts[0], counts[1]


def reduce_metrics(metrics: dict[str, float], weight: float) -> dict[str, float]:
    """Combine per-rank metrics into the global batch's: `loss` is summed (each rank's share is already
    divided by the global normaliser), `grad_norm` (global already) averaged, `*_max` / `*_min` take the
    extreme, the rest are token means weighted by `weight` (this rank's token count)."""
    if not is_distributed():
        return metrics
    extremes = [n for n in metrics if n.endswith(("_max", "_min"))]
    summed = [n for n in metrics if n not in extremes]
    per_rank = {"loss": 1.0, "grad_norm": 1.0 / dist.get_world_size()}
    sums = torch.tensor(
        [metrics[n] * per_rank.get(n, weight) for n in summed] + [weight],
        dtype=torch.float64,
        device=comm_device(),
    )
    dist.all_reduce(sums)
    total = max(float(sums[-1]), 1.0)
    out = {n: float(s) / (1.0 if n in per_rank else total) for n, s in zip(summed, sums.tolist())}
    if extremes:  # min(x) = -max(-x): one all-reduce for both kinds
        sign = torch.tensor([1.0 if n.endswith("_max") else -1.0 for n in extremes], dtype=torch.float64)
        values = sign * torch.tensor([metrics[n] for n in extremes], dtype=torch.float64)
        values = values.to(comm_device())
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        out.update({n: float(v) for n, v in zip(extremes, (sign * values.cpu()).tolist())})
    return out


# ---------------------------------------------------------------------------------------------- sharding


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: the classes Hugging Face marks as never to be split across devices
    (`_no_split_modules`), found anywhere inside (a peft wrapper included)."""
    names = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to shard (no _no_split_modules)")
    return layers


def mixed_precision_policy(name: str, device: torch.device):
    """FSDP2's MixedPrecisionPolicy for train.fsdp_mixed_precision: "bf16" (bf16 parameters for compute,
    fp32 gradient reduction) or "none" (the weights' own dtype throughout); "auto" is resolved by the config
    (TrainConfig.resolved_fsdp_mixed_precision), never here."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if name == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if name == "none":
        return MixedPrecisionPolicy()
    raise ValueError(f"fsdp mixed precision must be 'bf16' or 'none' (resolved), got {name!r}")


def shard_policy(model: nn.Module, mixed_precision: str = "none") -> nn.Module:
    """Shard `model` in place with FSDP2: each decoder layer is one unit, the root holds the rest.

    Gradients are summed over ranks, not averaged: the loss is already divided by global token/sequence
    counts. The root unit stays gathered from its forward to its backward, so the LM head is gathered once
    per micro-batch. Returns `model` (now also an FSDPModule).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    device = next(model.parameters()).device
    policy = mixed_precision_policy(mixed_precision, device)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
        # the aligned forward runs a layer's computation through this method (bitrl.rollout.decoder's
        # run_layer): its weights gathered around it as around the layer's own forward
        layer.bitrl_forward = (lambda self, fn: _own_storage(fn())).__get__(layer)
        register_fsdp_forward_method(layer, "bitrl_forward")
    # The root stays gathered after its forward (until its backward): the LM head the loss reads right
    # after the base model is then the gathered one, fetched once per micro-batch.
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied sum)
    # Computations that use the model's parts directly (base model, then the LM head's weight in a fused
    # op) run through this method, so that the root's parameters are gathered around them like a forward.
    model.bitrl_forward = (lambda self, fn: _own_storage(fn())).__get__(model)
    register_fsdp_forward_method(model, "bitrl_forward")
    return model


def _own_storage(out):
    """Views (e.g. the response slice of the hidden states) cloned: FSDP's backward hook on a returned view
    would be lost by any later in-place op on it."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t, out)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters an FSDP2 root keeps after a forward without backward; no-op unsharded."""
    if is_sharded(model):
        model.reshard()


@contextmanager
def gathered(model: nn.Module):
    """Every parameter of a sharded model gathered for the duration (a whole model on each rank), for work
    that reads the weights directly instead of calling the model, e.g. evaluation through the rollout
    engine; no-op unsharded."""
    units = [unit for _, unit in fsdp_units(model)] if is_sharded(model) else []
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()


def call_as_forward(model: nn.Module, fn):
    """fn() run as `model`'s forward: for an FSDP2 root, between its pre- and post-forward hooks (parameters
    gathered, gradients reduce-scattered in backward); plain `fn()` otherwise. Without autograd the root is
    resharded afterwards, as nothing will come back for it in a backward."""
    if not is_sharded(model):
        return fn()
    out = model.bitrl_forward(fn)
    if not torch.is_grad_enabled():
        reshard(model)
    return out


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor shard (all-gathered); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fsdp_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each FSDP unit, decoder layers first and the root last."""
    from torch.distributed.fsdp import FSDPModule

    units = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule) and m is not model]
    return [*units, ("", model)]


def unit_parameters(unit: nn.Module, unit_name: str):
    """(qualified name, parameter) of the parameters `unit` itself shards (not those of units inside it)."""
    from torch.distributed.fsdp import FSDPModule

    inner = [n for n, m in unit.named_modules() if n and isinstance(m, FSDPModule)]
    prefix = unit_name + "." if unit_name else ""
    for name, p in unit.named_parameters():
        if not any(name.startswith(i + ".") for i in inner):
            yield prefix + name, p


@torch.no_grad()
def broadcast_module_(module: nn.Module, src: int = 0) -> None:
    """Overwrite every parameter and buffer with rank `src`'s (before sharding, e.g. after a warm start)."""
    if not is_distributed():
        return
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src)


# ------------------------------------------------------------------------------------------- weight sync


@torch.no_grad()
def sync_rollout_model_sharded_(rollout_model: nn.Module, policy: nn.Module) -> dict:
    """Refresh every rank's full rollout copy from the sharded policy, one FSDP unit at a time: all-gather the
    unit's parameters (the fp32 master weights), cast or re-quantize them into the copy, free them.

    Peak extra memory is one decoder layer (or the root's embeddings and head) at full precision. Quantized
    layers (bitrl.quant.QuantLinear) are re-quantized from the gathered weight; everything else is copied
    (cast to the copy's dtype). A LoRA policy whose copy holds merged weights gets each unit's adapted layers
    re-merged while that unit is gathered (nothing else of it trains). Returns counts of what was done.
    """
    from bitrl.quant.linear import QuantLinear, _canon
    from bitrl.rollout.lora_merge import lora_layers
    from bitrl.rollout.precision import _sync_lora_, shared_base_modules

    reshard(policy)  # the root may still be gathered after a forward; sync reads the sharded masters
    lora = lora_layers(policy)
    merged = bool(lora) and not shared_base_modules(lora)
    targets = dict(rollout_model.named_parameters(remove_duplicate=False))
    qlinears = {_canon(m.source_name): m for m in rollout_model.modules() if isinstance(m, QuantLinear)}
    stats = {"requantized": 0, "copied": 0, "merged": 0}
    units = fsdp_units(policy)
    for unit_name, unit in units:
        if merged:
            mine = {n: m for n, m in lora.items() if _owner(n, units) == unit_name}
            if mine:
                unit.unshard()
                for key, value in _sync_lora_(rollout_model, policy, mine).items():
                    stats[key] = stats.get(key, 0) + value
                unit.reshard()
            continue
        for name, param in unit_parameters(unit, unit_name):
            name = _canon(name)
            full = full_tensor(param.detach())
            module_name, _, leaf = name.rpartition(".")
            if leaf == "weight" and module_name in qlinears:
                qlinears[module_name].set_weight(full)
                stats["requantized"] += 1
            elif name in targets:
                targets[name].copy_(full)
                stats["copied"] += 1
            else:
                raise ValueError(f"the rollout copy has no parameter {name!r}: is it a copy of this policy?")
            del full
    return stats


def _owner(module_name: str, units: list[tuple[str, nn.Module]]) -> str:
    """The name of the innermost FSDP unit holding module `module_name` (units from `fsdp_units`)."""
    holders = [n for n, _ in units if n == "" or module_name == n or module_name.startswith(n + ".")]
    return max(holders, key=len)
