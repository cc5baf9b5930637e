import math

import pytest
import torch

from bitrl.kernels.sampling import draw_step_seed, fused_sample, sample_seeds
from bitrl.rollout.batch import Rollout, left_pad
from bitrl.rollout.generation import RolloutEngine
from bitrl.rollout.settings import EngineOptions, Sampling, filtered_logprobs
from bitrl.train.logprobs import token_logprobs


def _prompts():
    return [[1, 5, 6, 7], [1, 8], [1, 9, 10, 11, 12, 13]]


def test_left_pad():
    ids, mask = left_pad([[3, 4], [5]], pad_id=0)
    assert ids.tolist() == [[3, 4], [0, 5]]
    assert mask.tolist() == [[True, True], [False, True]]
    with pytest.raises(ValueError):
        left_pad([[1], []], 0)


def test_generate_shapes_masks_and_eos(tiny_qwen):
    g = torch.Generator().manual_seed(0)
    r = RolloutEngine(tiny_qwen, Sampling(max_new_tokens=12, eos_id=2, pad_id=0)).generate(
        _prompts(), generator=g
    )
    assert r.response_ids.shape == r.response_mask.shape == r.logprobs.shape
    assert r.logprobs.dtype == torch.float32
    for ids, mask in zip(r.response_ids, r.response_mask):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # a contiguous prefix
        eos = (ids[:n] == 2).nonzero()
        assert len(eos) <= 1 and (len(eos) == 0 or eos.item() == n - 1)  # EOS only as the last kept token
        assert (ids[n:] == 0).all()
    assert (r.logprobs[~r.response_mask] == 0).all() and (r.logprobs[r.response_mask] <= 0).all()


def test_generate_is_deterministic_under_a_seed(tiny_qwen):
    engine = RolloutEngine(tiny_qwen, Sampling(max_new_tokens=8, eos_id=2, pad_id=0))
    runs = [engine.generate(_prompts(), generator=torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert torch.equal(runs[0].response_ids, runs[1].response_ids)
    assert torch.equal(runs[0].logprobs, runs[1].logprobs)
    assert not torch.equal(runs[0].response_ids, runs[2].response_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_rollout_logprobs_equal_a_full_forward(tiny_qwen, temperature):
    """The KV-cached, left-padded generation scores tokens exactly as one forward over the whole sequence."""
    g = torch.Generator().manual_seed(1)
    sampling = Sampling(max_new_tokens=10, eos_id=2, pad_id=0, temperature=temperature)
    r = RolloutEngine(tiny_qwen, sampling).generate(_prompts(), generator=g)
    with torch.no_grad():
        full, _ = token_logprobs(tiny_qwen, r, temperature=temperature)
    m = r.response_mask
    torch.testing.assert_close(r.logprobs[m], full[m], atol=1e-5, rtol=1e-5)


def test_grouped_prompts_are_prefilled_once_and_sampled_independently(tiny_qwen):
    """GRPO groups repeat each prompt G times: one prefill per distinct prompt, then one token per decode
    step for at most max_batch_rows rows, independent samples per row, and the same log-probs as a full
    forward over each row."""
    grouped = [p for p in _prompts() for _ in range(4)]
    calls = []
    hook = tiny_qwen.model.embed_tokens.register_forward_hook(
        lambda m, a, out: calls.append(tuple(a[0].shape))
    )
    engine = RolloutEngine(
        tiny_qwen, Sampling(max_new_tokens=10, eos_id=2, pad_id=0), EngineOptions(max_batch_rows=5)
    )
    try:
        r = engine.generate(grouped, generator=torch.Generator().manual_seed(3))
    finally:
        hook.remove()
    assert calls[0] == (3, 6)  # the three distinct prompts, once
    assert all(rows <= 5 and steps == 1 for rows, steps in calls[1:])
    assert r.prompt_ids.shape[0] == 12 and torch.equal(r.prompt_ids[0], r.prompt_ids[3])
    assert len({tuple(row.tolist()) for row in r.response_ids[:4]}) > 1  # a group's samples differ
    with torch.no_grad():
        full, _ = token_logprobs(tiny_qwen, r)
    m = r.response_mask
    torch.testing.assert_close(r.logprobs[m], full[m], atol=1e-5, rtol=1e-5)


def _generate(model, prompts, seed=5, options=None, sample_ids=None, **kw):
    sampling = Sampling(**dict(max_new_tokens=12, eos_id=2, pad_id=0, top_p=0.9) | kw)
    engine = RolloutEngine(model, sampling, options)
    return engine.generate(prompts, generator=torch.Generator().manual_seed(seed), sample_ids=sample_ids)


def _same_samples(a, b):
    assert torch.equal(a.response_mask, b.response_mask) and torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_continuous_batching_returns_the_samples_of_one_big_batch(tiny_qwen, rows):
    """Few slots (finished samples' slots taken by waiting ones) give the samples of one big batch."""
    grouped = [p for p in _prompts() for _ in range(3)]
    big = _generate(tiny_qwen, grouped)
    lengths = big.response_mask.sum(1)
    assert lengths.min() < lengths.max()  # uneven lengths: slots are recycled mid-way
    _same_samples(_generate(tiny_qwen, grouped, options=EngineOptions(max_batch_rows=rows)), big)
    every_3 = EngineOptions(max_batch_rows=4, sync_every=3)  # the host looks every 3 steps
    _same_samples(_generate(tiny_qwen, grouped, options=every_3), big)


def test_the_compiled_decode_step_returns_the_eager_samples(tiny_qwen):
    """rollout.compile=true (the decode step under torch.compile, one fixed shape: slots are recycled but the
    batch never shrinks) draws the eager reference's samples."""
    grouped = [p for p in _prompts() for _ in range(3)]
    eager = _generate(tiny_qwen, grouped)
    _same_samples(_generate(tiny_qwen, grouped, options=EngineOptions(max_batch_rows=4, compile=True)), eager)


def test_the_compiled_decode_step_compiles_once_for_many_rollouts(tiny_qwen, monkeypatch):
    """Rollouts of other batch sizes, prompt lengths and budgets reuse the compiled graphs of the first (a
    fixed slot count, the width rounded up to a power of two): a recompile per call would exhaust
    torch.compile's limit and silently fall back to eager. Counted with torch's own compile counter on a CPU
    backend."""
    from torch._dynamo.testing import CompileCounter

    from bitrl.rollout import decode_loop

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(decode_loop.next_tokens, backend=counter, dynamic=False)  # as the engine does
    monkeypatch.setitem(decode_loop._COMPILED_NEXT_TOKENS, "cpu", compiled)
    options = EngineOptions(max_batch_rows=8, compile=True)
    prompts = _prompts()

    def generate(batch, new_tokens):
        return RolloutEngine(
            tiny_qwen, Sampling(max_new_tokens=new_tokens, eos_id=2, pad_id=0), options
        ).generate(batch)

    try:
        frames = []
        for rows, new_tokens in ((3, 4), (12, 9), (5, 20), (1, 2)):
            batch = [prompts[i % len(prompts)][: 2 + i % 3] for i in range(rows)]
            r = generate(batch, new_tokens)
            assert r.response_ids.shape[0] == rows
            frames.append(counter.frame_count)
        assert frames[0] > 0 and frames == [frames[0]] * 4, frames  # nothing recompiled
        generate(prompts, 60)  # past 64 columns: one more
        assert frames[0] < counter.frame_count <= 2 * frames[0]
    finally:
        torch._dynamo.reset()


def test_compiled_widths_are_powers_of_two():
    from bitrl.rollout.decode_loop import compiled_width

    assert [compiled_width(c) for c in (1, 64, 65, 128, 129, 1000)] == [64, 64, 128, 128, 256, 1024]


def test_a_sample_depends_on_its_id_not_on_its_batch(tiny_qwen):
    """Shared-prefix groups equal separately prefilled prompts, and a subset of the rows with their global
    sample ids (another rank's share, another batch) draws the same samples."""
    grouped = [p for p in _prompts() for _ in range(3)]
    whole = _generate(tiny_qwen, grouped)
    for rows in ([4], [0, 8, 2], [7, 6]):
        ids = torch.tensor(rows)
        part = _generate(tiny_qwen, [grouped[i] for i in rows], sample_ids=ids)
        width = part.response_ids.shape[1]
        assert torch.equal(part.response_ids, whole.response_ids[ids, :width])
        assert not whole.response_mask[ids, width:].any()
        torch.testing.assert_close(part.logprobs, whole.logprobs[ids, :width], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="sample_ids"):
        _generate(tiny_qwen, grouped, sample_ids=torch.arange(3))


def test_fp8_kv_cache_mismatch_is_reported_by_the_diagnostics(tiny_qwen):
    """An FP8 KV cache samples from a slightly different policy than the trainer's forward: the mismatch
    diagnostics see it (the full-precision cache shows none)."""
    from bitrl.train.mismatch import mismatch_diagnostics

    grouped = [p for p in _prompts() for _ in range(4)]
    found = {}
    for kv in ("auto", "fp8"):
        r = _generate(tiny_qwen, grouped, options=EngineOptions(kv_cache_dtype=kv), top_p=1.0)
        with torch.no_grad():
            full, _ = token_logprobs(tiny_qwen, r, with_entropy=False)
        found[kv] = mismatch_diagnostics(full, r.logprobs, r.response_mask)
    assert found["auto"]["mismatch_max_abs_dp"] < 1e-5 and abs(found["auto"]["mismatch_k3_kl"]) < 1e-9
    assert 1e-5 < found["fp8"]["mismatch_max_abs_dp"] < 0.1 and 0 < found["fp8"]["mismatch_k3_kl"] < 1e-3


def test_engine_options_and_model_validation(tiny_qwen):
    for fields, name in [
        (dict(max_batch_rows=0), "max_batch_rows"),
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype"),
        (dict(compile="yes"), "compile"),
        (dict(sync_every=0), "sync_every"),
    ]:
        with pytest.raises(ValueError, match=name):
            EngineOptions(**fields)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=16)).eval()
    with pytest.raises(ValueError, match="Llama-family"):
        RolloutEngine(gpt2, Sampling(max_new_tokens=2, eos_id=2, pad_id=0)).generate(_prompts())


def test_rollout_logprobs_with_top_k_top_p_match_the_filtered_full_forward(tiny_qwen):
    g = torch.Generator().manual_seed(2)
    sampling = Sampling(max_new_tokens=10, eos_id=2, pad_id=0, top_k=6, top_p=0.8)
    r = RolloutEngine(tiny_qwen, sampling).generate(_prompts(), generator=g)
    ids, mask, pos = r.full_sequence()
    with torch.no_grad():
        logits = tiny_qwen(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
    p = r.prompt_ids.shape[1]
    logits = logits[:, p - 1 : p - 1 + r.response_ids.shape[1]]
    ref = filtered_logprobs(logits, 1.0, 6, 0.8).gather(-1, r.response_ids[..., None]).squeeze(-1)
    m = r.response_mask
    assert torch.isfinite(ref[m]).all()  # every sampled token lies in the kept support
    torch.testing.assert_close(r.logprobs[m], ref[m], atol=2e-5, rtol=1e-5)


def test_filtered_logprobs_support_and_normalisation():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    lp = filtered_logprobs(logits, top_k=3)
    assert torch.isinf(lp[0, 3:]).all() and math.isclose(lp.exp().sum().item(), 1.0, rel_tol=1e-6)
    # top-p keeps the smallest prefix whose mass reaches p: here the first two tokens.
    p = float(probs[:2].sum()) - 1e-4
    lp = filtered_logprobs(logits, top_p=p)
    assert torch.isfinite(lp[0, :2]).all() and torch.isinf(lp[0, 2:]).all()
    # top-p below the first token's mass still keeps the first token.
    assert torch.isfinite(filtered_logprobs(logits, top_p=0.01)[0]).sum() == 1


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.5, 0, 0.7), (1.0, 3, 0.9)]
)
def test_empirical_sampling_frequencies_match_the_distribution(temperature, top_k, top_p):
    """Many draws from a 6-token vocabulary: frequencies match the filtered distribution (chi-square)."""
    logits = torch.tensor([2.0, 1.5, 0.5, 0.0, -0.5, -2.0])
    n = 60000
    g = torch.Generator().manual_seed(0)
    seeds = sample_seeds(draw_step_seed(g), torch.arange(n))  # one step seed, rows keyed by their index
    positions = torch.zeros(n, dtype=torch.long)
    tokens, logps = fused_sample(logits.expand(n, -1), seeds, positions, temperature, top_k, top_p)
    expected = filtered_logprobs(logits, temperature, top_k, top_p).exp()
    counts = torch.bincount(tokens, minlength=6).double()
    support = expected > 0
    assert (counts[~support] == 0).all()
    chi2 = (((counts - n * expected) ** 2) / (n * expected))[support].sum().item()
    dof = int(support.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, chi2  # far beyond the 99.99th percentile otherwise
    torch.testing.assert_close(logps, expected.log()[tokens].float())


def test_greedy_decoding_has_zero_logprob(tiny_qwen):
    r = RolloutEngine(tiny_qwen, Sampling(max_new_tokens=4, eos_id=2, pad_id=0, temperature=0.0)).generate(
        _prompts()
    )
    assert (r.logprobs == 0).all()
    with torch.no_grad():
        first = tiny_qwen(input_ids=torch.tensor([_prompts()[0]])).logits[0, -1].argmax()
    assert r.response_ids[0, 0] == first


def test_rollout_dataclass_full_sequence_positions():
    r = Rollout(
        prompt_ids=torch.tensor([[0, 1, 5]]),
        prompt_mask=torch.tensor([[False, True, True]]),
        response_ids=torch.tensor([[6, 2, 0]]),
        response_mask=torch.tensor([[True, True, False]]),
        logprobs=torch.zeros(1, 3),
    )
    ids, mask, pos = r.full_sequence()
    assert pos.tolist() == [[0, 0, 1, 2, 3, 3]] and r.num_tokens == 2


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_mx_rollout_scale_mode_reaches_every_layer_and_survives_sync(tiny_qwen, mode):
    import copy

    from bitrl.quant import QuantLinear
    from bitrl.rollout.precision import make_rollout_model, sync_rollout_model_

    policy = copy.deepcopy(tiny_qwen)
    from bitrl.quant.recipe import recipe_for

    rollout = make_rollout_model(policy, "mxfp4", recipe_for("mxfp4", scale_mode=mode, outlier_tau=None))
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.5)
    sync_rollout_model_(rollout, policy, "mxfp4")
    layers = [m for m in rollout.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.qweight.scale_mode == mode for m in layers)
    # In units of the block scale s, E2M1's widest gap (4 -> 6) is 2, so rounding is off by at most 1·s.
    # rceil never saturates; floor clips block maxima above 6·s at 6·s, off by up to 2·s.
    q = layers[0]
    src = policy.get_submodule(q.source_name).weight
    err = (q.dequantized_weight(torch.float32) - src).abs()
    amax = src.abs().reshape(src.shape[0], -1, 32).amax(-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax / 6)) if mode == "rceil" else torch.floor(torch.log2(amax)) - 2
    scale = (2**exponent).expand(-1, -1, 32).reshape(src.shape)
    within_rounding = bool((err <= scale * (1 + 1e-6)).all())
    assert within_rounding == (mode == "rceil")


def test_a_kv_cache_the_forward_ignored_is_an_error(tiny_qwen):
    """A forward handed the cache under a name it does not know leaves it empty: caught, never decoded."""
    from transformers import DynamicCache

    from bitrl.rollout.decoder import check_cache_filled, with_cache

    ids = torch.tensor([[3, 4, 5]])
    ignored = DynamicCache(config=tiny_qwen.config)
    tiny_qwen(input_ids=ids, unknown_cache_name=ignored, use_cache=True)
    with pytest.raises(RuntimeError, match="did not fill the KV cache"):
        check_cache_filled(ignored, 3)
    used = DynamicCache(config=tiny_qwen.config)
    tiny_qwen(input_ids=ids, **with_cache(tiny_qwen, used))
    check_cache_filled(used, 3)


def test_grouped_query_attention_keeps_the_fused_kernels(tiny_qwen, monkeypatch):
    """The decoder's attention (4 query heads over 2 KV heads, a bool mask) is one query block per KV head:
    no enable_gqa, whose pairing with a mask leaves CUDA only the math kernel, and a fused kernel chosen."""
    import torch.nn.functional as F

    from bitrl.rollout import decoder

    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, False, scale=kw.get("scale"))
        calls.append((q.shape, k.shape, attn_mask.shape, kw, choice))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(decoder.F, "scaled_dot_product_attention", spy)
    RolloutEngine(tiny_qwen, Sampling(max_new_tokens=3, eos_id=2, pad_id=0)).generate(
        _prompts(), generator=torch.Generator()
    )
    assert calls
    for q, k, mask, kw, choice in calls:
        assert "enable_gqa" not in kw and q[1] == k[1] == 2, (q, k)  # [rows, kv heads, 2 * steps, d]
        assert mask[2] == q[2] and mask[3] == k[2]
        assert choice != 0, "the math kernel"  # torch.nn.attention.SDPBackend.MATH


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (SDPA's CUDA kernels)")
def test_decoder_attention_runs_without_the_math_kernel_on_cuda(tiny_qwen):  # pragma: no cover - GPU only
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = tiny_qwen.cuda().to(torch.bfloat16)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):  # the math kernel is not allowed: a fallback to it raises
        engine = RolloutEngine(model, Sampling(max_new_tokens=4, eos_id=2, pad_id=0))
        r = engine.generate(_prompts(), generator=torch.Generator())
    assert r.response_ids.shape[0] == len(_prompts())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
def test_the_compiled_decode_step_runs_as_cuda_graphs(tiny_qwen):  # pragma: no cover - GPU only
    """mode="reduce-overhead" takes its CUDA graphs: the step mutates only static slot buffers (a mutated
    non-static input would make inductor skip the graph, and count the skip)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_qwen.cuda()
    engine = RolloutEngine(
        model, Sampling(max_new_tokens=6, eos_id=2, pad_id=0), EngineOptions(max_batch_rows=8, compile=True)
    )
    for rows in (3, 8, 5):
        engine.generate(_prompts()[:1] * rows)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "precision,kv", [("full", "fp8"), ("fp8", "auto"), ("nvfp4", "auto"), ("mxfp4", "fp8")]
)
def test_low_precision_rollouts_on_cuda(tiny_qwen, precision, kv):  # pragma: no cover - GPU only
    """Quantized rollout copies and the FP8 KV cache on the GPU: finite samples whose log-probs stay close to
    the bf16 policy's (the mismatch the corrections then handle), the compiled step included."""
    from bitrl.rollout.precision import make_rollout_model

    policy = tiny_qwen.cuda().to(torch.bfloat16)
    copy = make_rollout_model(policy, precision)
    sampling, options = (
        Sampling(max_new_tokens=8, eos_id=2, pad_id=0),
        EngineOptions(kv_cache_dtype=kv, compile=True),
    )
    r = RolloutEngine(copy, sampling, options).generate(_prompts() * 4, generator=torch.Generator())
    m = r.response_mask
    assert m.any() and torch.isfinite(r.logprobs[m]).all()
    with torch.no_grad():
        train, _ = token_logprobs(policy, r)
    k3 = (train - r.logprobs).exp() - (train - r.logprobs) - 1
    assert float(k3[m].mean()) < 0.5, float(k3[m].mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_norms_and_mlp_of_a_cpu_decode_step_match_the_modules(tiny_qwen, dtype):
    """A CPU decode step runs RMSNorm and silu(gate) * up through the host kernels: the samples' log-probs
    match those of the same rollout through the model's own modules (same tokens up to rounding)."""
    from bitrl.kernels.host_ext import load_host_library
    from bitrl.rollout.decoder import Decoder

    if load_host_library() is None:
        pytest.skip("the host kernels need a C++ compiler")
    model = tiny_qwen.to(dtype)
    sampling = Sampling(max_new_tokens=8, eos_id=-1, pad_id=0)
    host = RolloutEngine(model, sampling)
    assert Decoder(model)._host_elementwise
    plain = RolloutEngine(model, sampling)
    plain.decoder._host_elementwise = False
    a = host.generate(_prompts(), generator=torch.Generator().manual_seed(3))
    b = plain.generate(_prompts(), generator=torch.Generator().manual_seed(3))
    same = (a.response_ids == b.response_ids).all(-1)
    assert same.any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.logprobs[same], b.logprobs[same], atol=tol, rtol=tol)


def _tiny_llama_family(arch: str):
    """A tiny Llama (head_dim 16) or Qwen2 (biased q, k, v) from the shared test config."""
    from conftest import TINY_QWEN, make_qwen
    from transformers import LlamaConfig, LlamaForCausalLM

    if arch == "llama":
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**{**TINY_QWEN, "head_dim": 16})).eval()
    return make_qwen(**TINY_QWEN)


def _assert_mostly_same_samples(a, b, tol=1e-5):
    """Two rollouts of one model and seed through two forms of its products: at least 90% of the rows
    sample the same tokens, and those rows' log-probs agree within tol."""
    same = (a.response_ids == b.response_ids).all(-1)
    assert same.float().mean() >= 0.9
    torch.testing.assert_close(a.logprobs[same], b.logprobs[same], atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="packed products need oneDNN")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_decode_step_matches_the_plain_one_and_follows_weight_syncs(arch, monkeypatch):
    """Where the CPU packs products, the decoder runs every plain linear layer packed (q, k, v stacked, the
    MLP's steps and the residual adds fused; Qwen2's biases included): the samples and log-probs of the
    modules' own products up to their rounding; a weight synced in place is packed again before the next
    rollout samples from it."""
    from bitrl.kernels import packed_linear

    monkeypatch.setattr("bitrl.rollout.decoder.use_packed_linear", lambda dtype, device: True)
    model = _tiny_llama_family(arch)
    sampling = Sampling(max_new_tokens=10, eos_id=-1, pad_id=0)
    prompts = _prompts() * 8
    packed = RolloutEngine(model, sampling)
    assert packed.decoder.packed_products and not packed.decoder.weight_major_layers
    plain = RolloutEngine(model, sampling)
    plain.decoder.packed_products = False
    calls = []
    real = packed_linear.packed_linear
    counted = lambda *a, **k: calls.append(1) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr("bitrl.rollout.decoder.packed_linear", counted)
    a = packed.generate(prompts, generator=torch.Generator().manual_seed(4))
    assert not packed.decoder._packs  # freed when the rollout ends
    layers = model.config.num_hidden_layers
    assert len(calls) >= 10 * (4 * layers + 1)  # every step: 4 products per layer, the head
    calls.clear()
    b = plain.generate(prompts, generator=torch.Generator().manual_seed(4))
    assert not calls
    _assert_mostly_same_samples(a, b)

    with torch.no_grad():  # a sync in place, as the trainer's weights reach the rollout copy
        for p in model.parameters():
            p.mul_(1.5)
    a = packed.generate(prompts, generator=torch.Generator().manual_seed(5))
    b = plain.generate(prompts, generator=torch.Generator().manual_seed(5))
    _assert_mostly_same_samples(a, b)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weight_major_decode_step_matches_the_row_major_one(arch, monkeypatch):
    """At 16-256 rows an fp32 CPU decode step keeps its activations feature-major and runs every product
    weight-major (Qwen2's biases included): the same samples and log-probs as the row-major step (the same
    bits where the CPU's two product forms have them), and a model it cannot run that way is not."""
    from conftest import TINY_QWEN, make_qwen

    from bitrl.kernels.host_ext import load_host_library
    from bitrl.rollout.decoder import Decoder

    if load_host_library() is None:
        pytest.skip("the host kernels need a C++ compiler")
    model = _tiny_llama_family(arch)
    sampling = Sampling(max_new_tokens=12, eos_id=-1, pad_id=0)
    prompts = _prompts() * 8  # 24 rows decoding at once
    monkeypatch.setattr("bitrl.rollout.decoder.use_packed_linear", lambda dtype, device: False)
    fast = RolloutEngine(model, sampling)
    assert fast.decoder.weight_major_layers
    plain = RolloutEngine(model, sampling)
    plain.decoder.weight_major_layers = False
    calls = []
    real = Decoder._layer_weight_major
    monkeypatch.setattr(Decoder, "_layer_weight_major", lambda *a: calls.append(1) or real(*a))
    a = fast.generate(prompts, generator=torch.Generator().manual_seed(4))
    assert len(calls) >= 11 * 2  # every decode step, each layer
    calls.clear()
    b = plain.generate(prompts, generator=torch.Generator().manual_seed(4))
    assert not calls
    _assert_mostly_same_samples(a, b)
    assert not Decoder(make_qwen(**TINY_QWEN).bfloat16()).weight_major_layers  # fp32 only
