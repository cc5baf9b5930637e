"""Hadamard rotations of a Llama-family model's rollout copy, applied before it is quantized (QuaRot-style).

A 4-bit block format spends its few levels on the largest element of each block; a rotation spreads a row's
outliers over the block first, so the scale fits the rest too. With R orthogonal (bitrl.kernels.hadamard:
block-diagonal random Hadamard), every rotation below leaves the model's function unchanged up to rounding:

    residual stream   h' = h R                embed E' = E R
    readers of h      W' = W diag(g) R        q, k, v, gate, up, lm_head; g, the RMSNorm before them, -> 1
    writers of h      W' = R^T W              o_proj, down_proj (bias b' = b R)
    values per head   W_v' = R_d^T W_v        o_proj reads them back: W_o' = R^T W_o R_d
    MLP hidden        x R_m online            down_proj: W_d' = R^T W_d R_m, its input rotated at run time

RMSNorm commutes with the residual rotation once its scale g is folded into the readers (|h R| = |h|), the
values' rotation passes through attention (a weighted sum of rows), and only the MLP's hidden state, behind
the elementwise SiLU gate, has no neighbour to absorb R_m: ``InputRotation`` rotates it (one [rows, I]
Hadamard product per layer and token, ~2 * block / H of down_proj's FLOPs). A tied LM head is untied in the
copy (one more [V, H] matrix) because E and the head fold different norms.

Every rotated tensor is a function of the source model's tensors (``rotated_tensors``): the copy is built
from it once and refreshed from the policy at every weight sync (``sync_rotated_``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from bitrl.kernels.hadamard import block_hadamard, random_signs

__all__ = ["InputRotation", "Rotation", "rotate_model_", "rotated_tensors", "sync_rotated_"]


@dataclass(frozen=True)
class Rotation:
    """mode: "residual" (the folded rotations above, plus down_proj's input online) or "inputs" (every
    quantized linear's input rotated online, W' = W R, no folding: the norms keep their scales); block: the
    Hadamard block (a power of two; each dimension uses the largest power of two <= block dividing it);
    seed: the random signs."""

    mode: str = "residual"
    block: int = 32
    seed: int = 0

    def __post_init__(self):
        if self.mode not in ROTATION_MODES:
            modes = ("none", *ROTATION_MODES)
            raise ValueError(f"rollout.rotation must be one of {modes}, got {self.mode!r}")
        if self.block < 2 or self.block & (self.block - 1):
            raise ValueError(f"rollout.rotation_block must be a power of two >= 2, got {self.block}")


ROTATION_MODES = ("residual", "inputs")


def _block_for(dim: int, block: int) -> int:
    b = block
    while dim % b:
        b //= 2
    return b


class _Signs:
    """The sign vectors of one model (seeded per role, so the copy and every sync draw the same ones)."""

    def __init__(self, model: nn.Module, rotation: Rotation, device):
        config = model.config
        layer = model.model.layers[0]
        self.dim = model.model.embed_tokens.weight.shape[1]
        self.head_dim = layer.self_attn.head_dim
        self.mlp_dim = layer.mlp.down_proj.weight.shape[1]
        self.res = random_signs(self.dim, rotation.seed, device)
        head = random_signs(self.head_dim, rotation.seed + 1, device)
        self.values = head.repeat(config.num_key_value_heads)  # v_proj's output, head by head
        self.heads = head.repeat(config.num_attention_heads)  # o_proj's input: the same signs per head
        self.mlp = random_signs(self.mlp_dim, rotation.seed + 2, device)
        self.b_res = _block_for(self.dim, rotation.block)
        self.b_head = _block_for(self.head_dim, rotation.block)
        self.b_mlp = _block_for(self.mlp_dim, rotation.block)


def _inputs(w, signs, block):  # W R: rotate the input dimension (W [out, in])
    return block_hadamard(w, signs, block)


def _outputs(w, signs, block):  # R^T W: rotate the output dimension, (R^T W)^T = W^T R
    return block_hadamard(w.t(), signs, block).t()


def _weight(module: nn.Module) -> torch.Tensor:
    inner = module.inner if isinstance(module, InputRotation) else module
    return inner.weight


@torch.no_grad()
def rotated_tensors(model: nn.Module, rotation: Rotation) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor the rotation changes, computed from ``model``'s current weights.

    Names are those of an unrotated Hugging Face Llama-family model (``model.layers.0.mlp.down_proj.weight``,
    ``lm_head.weight`` even when tied); tensors keep their source dtypes. "residual": norm scales come out as
    ones. "inputs": every linear of the decoder layers, W R over its input."""
    if rotation.mode == "inputs":
        for name, module in _rotated_inputs(model):
            signs = random_signs(module.in_features, rotation.seed, module.weight.device)
            block = _block_for(module.in_features, rotation.block)
            yield f"{name}.weight", _inputs(module.weight, signs, block)
        return
    inner = model.model
    device = inner.embed_tokens.weight.device
    s = _Signs(model, rotation, device)
    yield "model.embed_tokens.weight", _inputs(inner.embed_tokens.weight, s.res, s.b_res)
    for i, layer in enumerate(inner.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        g = layer.input_layernorm.weight
        for name in ("q_proj", "k_proj"):
            w = getattr(attn, name).weight
            yield p + f"self_attn.{name}.weight", _inputs(w * g, s.res, s.b_res)
        w_v = _inputs(attn.v_proj.weight * g, s.res, s.b_res)
        yield p + "self_attn.v_proj.weight", _outputs(w_v, s.values, s.b_head)
        if attn.v_proj.bias is not None:
            yield p + "self_attn.v_proj.bias", block_hadamard(attn.v_proj.bias, s.values, s.b_head)
        w_o = _inputs(attn.o_proj.weight, s.heads, s.b_head)
        yield p + "self_attn.o_proj.weight", _outputs(w_o, s.res, s.b_res)
        if attn.o_proj.bias is not None:
            yield p + "self_attn.o_proj.bias", block_hadamard(attn.o_proj.bias, s.res, s.b_res)
        yield p + "input_layernorm.weight", torch.ones_like(g)
        g = layer.post_attention_layernorm.weight
        for name in ("gate_proj", "up_proj"):
            w = getattr(mlp, name).weight
            yield p + f"mlp.{name}.weight", _inputs(w * g, s.res, s.b_res)
        w_d = _inputs(_weight(mlp.down_proj), s.mlp, s.b_mlp)
        yield p + "mlp.down_proj.weight", _outputs(w_d, s.res, s.b_res)
        yield p + "post_attention_layernorm.weight", torch.ones_like(g)
    g = inner.norm.weight
    yield "lm_head.weight", _inputs(model.get_output_embeddings().weight * g, s.res, s.b_res)
    yield "model.norm.weight", torch.ones_like(g)


class InputRotation(nn.Module):
    """A linear layer that rotates its input first: ``forward(x) = inner(x R)`` (x [..., in])."""

    def __init__(self, inner: nn.Module, signs: torch.Tensor, block: int):
        super().__init__()
        self.inner = inner
        self.block = block
        self.register_buffer("signs", signs.to(torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(block_hadamard(x, self.signs, self.block))

    def extra_repr(self) -> str:
        return f"block={self.block}"


def _rotated_inputs(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, linear) of the decoder layers' linears, those a rollout copy quantizes ("inputs" mode)."""
    modules = model.named_modules()
    return [(n, m) for n, m in modules if isinstance(m, nn.Linear) and n.startswith("model.layers.")]


def _check_model(model: nn.Module) -> None:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        raise ValueError("rollout.rotation: needs a Llama-family causal LM (embed_tokens, layers, norm)")
    if getattr(model.config, "model_type", None) in ("gemma", "gemma2", "gemma3"):
        raise ValueError("rollout.rotation: Gemma's RMSNorm scales by 1 + g, unlike the folding")


def _target(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, param = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, InputRotation):
        module = module.inner
    return module, param


def _assign(model: nn.Module, name: str, value: torch.Tensor) -> None:
    from .linear import QuantLinear

    module, param = _target(model, name)
    if isinstance(module, QuantLinear) and param == "weight":
        module.set_weight(value)
    else:
        getattr(module, param).copy_(value)


@torch.no_grad()
def rotate_model_(model: nn.Module, rotation: Rotation) -> nn.Module:
    """Rotate ``model`` (a float rollout copy, before quantization) in place; returns it."""
    _check_model(model)
    if rotation.mode == "inputs":
        for name, value in list(rotated_tensors(model, rotation)):
            _assign(model, name, value)
        for name, module in _rotated_inputs(model):
            signs = random_signs(module.in_features, rotation.seed, module.weight.device)
            parent_name, _, child = name.rpartition(".")
            wrapped = InputRotation(module, signs, _block_for(module.in_features, rotation.block))
            setattr(model.get_submodule(parent_name), child, wrapped)
        model._bitrl_rotation = rotation
        return model
    head = model.get_output_embeddings()
    if head.weight is model.model.embed_tokens.weight:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
    for name, value in list(rotated_tensors(model, rotation)):
        _assign(model, name, value)
    s = _Signs(model, rotation, model.model.embed_tokens.weight.device)
    for layer in model.model.layers:
        layer.mlp.down_proj = InputRotation(layer.mlp.down_proj, s.mlp, s.b_mlp)
    model._bitrl_rotation = rotation
    return model


@torch.no_grad()
def sync_rotated_(rollout_model: nn.Module, policy: nn.Module, rotation: Rotation) -> dict:
    """Refresh a rotated rollout copy from the policy's current weights: every rotated tensor is recomputed
    (and re-quantized where the copy is quantized), every other tensor copied. Returns counts."""
    rotated = dict(rotated_tensors(policy, rotation))
    for name, value in rotated.items():
        _assign(rollout_model, name, value)
    copied = 0
    for name, src in policy.named_parameters(remove_duplicate=False):
        if name not in rotated:
            _assign(rollout_model, name, src.detach())
            copied += 1
    return {"rotated": len(rotated), "copied": copied}
