"""bitrl inside a real TRL GRPOTrainer: a tiny Qwen2 built from a config, a local tokenizer, CPU, fp32."""

import copy
import json

import pytest
import torch

pytest.importorskip("trl", reason="TRL is a test dependency (pip install -e .[dev])")

from conftest import fp32_logprob_bound, save_tiny_hf_model  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from bitrl.engine.cli import main as cli_main  # noqa: E402
from bitrl.integrations.trl import add_bitrl_lm_head, use_bitrl  # noqa: E402
from bitrl.train.mismatch import mismatch_diagnostics  # noqa: E402

PROMPTS = ["1+1=", "2+3=", "4+4=", "5+2="]


def length_reward(completions, **_):
    return [len(c) / 10.0 for c in completions]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("trl") / "model"
    save_tiny_hf_model(d)
    return d


def make_trainer(model_dir, tmp_path, loss_type="grpo", max_steps=2, **config):
    torch.manual_seed(0)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=max_steps,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        learning_rate=1e-2,
        optim="sgd",
        bf16=False,
        num_iterations=2,
        loss_type=loss_type,
        disable_tqdm=True,
        **config,
    )
    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )


@pytest.mark.parametrize(
    "loss_type, config",
    [
        ("grpo", {}),
        ("dr_grpo", {"beta": 0.1}),
        ("cispo", {"epsilon_high": 5.0}),  # the same normaliser as dapo and vespo
        ("sapo", {}),
        ("luspo", {"importance_sampling_level": "sequence"}),
        ("bnpo", {"entropy_coef": 0.01}),
    ],
)
def test_grpo_trainer_two_steps_match_trl(model_dir, tmp_path, loss_type, config):
    """Two optimizer steps (the second off-policy: ratio != 1) give TRL's losses and weights."""
    runs = []
    for with_bitrl in (False, True):
        trainer = make_trainer(model_dir, tmp_path, loss_type, **config)
        if with_bitrl:
            use_bitrl(trainer)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        runs.append((logs, [p.detach().clone() for p in trainer.model.parameters()]))
    (trl_logs, trl_params), (our_logs, our_params) = runs
    assert len(trl_logs) == len(our_logs) == 2
    for a, b in zip(trl_logs, our_logs):
        assert b["loss"] == pytest.approx(a["loss"], abs=2e-6, rel=1e-4)
        assert b["entropy"] == pytest.approx(a["entropy"], abs=1e-5)
        for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            if key in a and key in b:
                assert b[key] == pytest.approx(a[key], abs=1e-5)
    assert any("bitrl/ratio_mean" in h for h in our_logs)
    for p, q in zip(trl_params, our_params):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5)


def test_bitrl_head_matches_trl_head_and_reference(model_dir):
    """Log-probs, entropies and gradients of bitrl's LM head equal TRL's and the fp64 formula."""
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    add_fused_lm_head(theirs, temperature=0.7, outputs=("log_probs", "entropy"))
    add_fused_lm_head(ours, temperature=0.7, outputs=("log_probs", "entropy"))
    add_bitrl_lm_head(ours, temperature=0.7, outputs=("log_probs", "entropy"), impl="torch")
    ids = torch.randint(4, 40, (3, 11))
    attention = torch.ones_like(ids)
    attention[2, :3] = 0  # left padding
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :4] = -100
    outs = [
        m(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True) for m in (theirs, ours)
    ]
    with torch.no_grad():
        hidden = base.base_model(input_ids=ids, attention_mask=attention).last_hidden_state[:, :-1].double()
        logp = torch.log_softmax(hidden @ base.lm_head.weight.double().T / 0.7, -1)
        mask = labels[:, 1:] != -100
        ref_lp = logp.gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
        ref_ent = -(logp.exp() * logp).sum(-1) * mask
    # Within the fp32 formula's worst-case rounding of the fp64 reference, in any summation order; the two
    # heads each within it, so within twice it of each other.
    n_ids = hidden.shape[:2]
    bound = fp32_logprob_bound(hidden.flatten(0, 1), base.lm_head.weight, 0.7).view(n_ids) * mask
    logp_max = logp.abs().amax(-1)
    assert ((outs[1].log_probs.double() - ref_lp).abs() <= bound).all()
    assert ((outs[1].entropy.double() - ref_ent).abs() <= (1 + logp_max) * bound).all()
    assert ((outs[1].log_probs - outs[0].log_probs).abs() <= 2 * bound).all()
    for out in outs:
        (out.log_probs.sum() + 0.3 * out.entropy.sum()).backward()
    for p, q in zip(theirs.parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=2e-6, rtol=1e-4)
    assert ours(input_ids=ids).logits.shape == (3, 11, base.config.vocab_size)  # plain forward unchanged


def _rollout_batch(trainer, model_dir):
    """A batch from the trainer's own generation, plus rollout log-probs from a bf16 copy of the policy."""
    inputs = trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 4)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    rollout = AutoModelForCausalLM.from_pretrained(model_dir).to(torch.bfloat16)
    L = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        logits = rollout(input_ids=ids, attention_mask=attention).logits[:, -L - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    inputs["sampling_per_token_logps"] = lp * inputs["completion_mask"]
    return inputs


def _hand_grpo_loss(model, inputs, weight, keep):
    """TRL's grpo loss by hand (fp64): sequence mean (over all B rows) of token means over ``keep`` of
    weight * clipped surrogate."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    L = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -L - 1 : -1].double()
        lp = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    r = torch.exp(lp - inputs["old_per_token_logps"].double())
    adv = inputs["advantages"].double().unsqueeze(1)
    surrogate = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv) * weight
    m = keep.double()
    return ((surrogate * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()


@pytest.mark.parametrize("correction", ["icepop", "mask-seq"])
def test_correction_changes_the_loss_as_hand_computed(model_dir, tmp_path, correction):
    trainer = make_trainer(model_dir, tmp_path)
    inputs = _rollout_batch(trainer, model_dir)
    m = inputs["completion_mask"].bool()
    log_rho = (inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]).double() * m
    rho = log_rho.exp()
    if correction == "icepop":  # a narrow window so that the bf16 rollout leaves some tokens out
        lo, hi = rho[m].quantile(0.25).item(), rho[m].quantile(0.75).item()
        options = {"icepop_alpha": lo, "icepop_beta": hi}
        weight = torch.where((rho >= lo) & (rho <= hi), rho, torch.zeros_like(rho))
        keep = m
    else:
        seq = log_rho.sum(-1).exp()
        lo = seq.median().item()
        options = {"correction_low": lo, "correction_high": 10.0}
        keep = m & ((seq >= lo) & (seq <= 10.0)).unsqueeze(-1)
        weight = torch.ones_like(rho)
    assert 0 < (weight * keep)[m].count_nonzero() < m.sum()  # the correction bites, but not everywhere
    plain = trainer.compute_loss(trainer.model, inputs).item()
    use_bitrl(trainer, correction=correction, **options)
    got = trainer.compute_loss(trainer.model, inputs)
    want = _hand_grpo_loss(trainer.model, inputs, weight, keep)
    assert got.item() == pytest.approx(want.item(), abs=1e-6, rel=1e-5)
    assert got.item() != pytest.approx(plain, abs=1e-6)
    assert any("bitrl/mismatch_k3" in logged for logged in trainer._metrics.values())


@pytest.mark.parametrize("loss_type", ["grpo", "vespo"])
def test_trl_importance_sampling_ratio_is_applied_as_trl_does(model_dir, tmp_path, loss_type):
    """Without a bitrl correction, TRL's vLLM importance-sampling ratio weights the loss exactly as in TRL."""
    trainer = make_trainer(model_dir, tmp_path, loss_type=loss_type)
    inputs = _rollout_batch(trainer, model_dir)
    m = inputs["completion_mask"]
    ratio = torch.exp((inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]) * m)
    inputs["importance_sampling_ratio"] = ratio.clamp(max=1.002)  # TRL's token_truncate, cap inside the data
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True  # as TRL sets them with vLLM
    params = list(trainer.model.parameters())
    theirs = trainer.compute_loss(trainer.model, inputs)
    grads_theirs = torch.autograd.grad(theirs, params)
    use_bitrl(trainer)
    ours = trainer.compute_loss(trainer.model, inputs)
    grads_ours = torch.autograd.grad(ours, params)
    # the per-token terms are O(|A| |log p|) ~ 4 and cancel within each group: fp32 rounding of the two LM
    # heads' log-probs (~2e-7) shows up at ~1e-6 absolute
    assert ours.item() == pytest.approx(theirs.item(), abs=2e-6, rel=1e-5)
    for a, b in zip(grads_ours, grads_theirs):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-4)


def test_refusals(model_dir, tmp_path):
    trainer = make_trainer(model_dir, tmp_path, use_adaptive_entropy=True, entropy_coef=0.01)
    with pytest.raises(ValueError, match="use_adaptive_entropy"):
        use_bitrl(trainer)
    trainer = make_trainer(model_dir, tmp_path)
    with pytest.raises(ValueError, match="unknown"):
        use_bitrl(trainer, correction="no-such-correction")
    with pytest.raises(TypeError, match="icepop_gamma"):
        use_bitrl(trainer, correction="icepop", icepop_gamma=1.0)
    use_bitrl(trainer, correction="icepop")
    inputs = trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 4)
    with pytest.raises(ValueError, match="rollout log-probs"):
        trainer.compute_loss(trainer.model, inputs)


def test_dump_for_external_mismatch(model_dir, tmp_path):
    trainer = make_trainer(model_dir, tmp_path)
    use_bitrl(trainer, correction="tis-token", dump_dir=str(tmp_path / "dump"))
    inputs = _rollout_batch(trainer, model_dir)
    trainer.compute_loss(trainer.model, inputs)
    rows = [
        json.loads(line) for line in (tmp_path / "dump" / "rollout_logprobs.jsonl").read_text().splitlines()
    ]
    assert len(rows) == len(PROMPTS)
    n = int(inputs["completion_mask"][0].sum())
    assert rows[0]["old_logprobs"] == pytest.approx(inputs["old_per_token_logps"][0, :n].tolist())

    # bitrl mismatch reads it without a model and reports the same diagnostics as bitrl's own
    out = tmp_path / "report"
    assert (
        cli_main(
            ["mismatch", "--external", str(tmp_path / "dump" / "rollout_logprobs.jsonl"), "--out", str(out)]
        )
        == 0
    )
    report = json.loads((out / "mismatch.json").read_text())
    mask = inputs["completion_mask"].bool()
    want = mismatch_diagnostics(inputs["old_per_token_logps"], inputs["sampling_per_token_logps"], mask)
    assert report["num_tokens"] == int(mask.sum())
    for key, value in want.items():
        assert report[key] == pytest.approx(value, rel=1e-5, abs=1e-7)
    assert (out / "mismatch.png").is_file()


@pytest.mark.parametrize("op", ["logprob_entropy", "grpo_loss"])
def test_benchmark_variants_compute_the_same_thing(op):
    """The benchmark's variants (bitrl, TRL's kernel, Liger-Kernel, naive) agree on loss and gradients."""
    from bitrl.benchmarks import bench_integrations as bench

    grads = {}
    for name in bench.VARIANTS[op]:
        x = bench.make_inputs(64, 512, torch.float32, B=4, Hd=32)
        bench.variant_fn(op, name)(x)
        grads[name] = (x["h"].grad, x["w"].grad)
    for name, (gh, gw) in grads.items():
        torch.testing.assert_close(gh, grads["naive"][0], atol=1e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(gw, grads["naive"][1], atol=1e-5, rtol=1e-4, msg=name)
    assert bench.planned_gb(op, "naive", 8192, 151936, "fp32") > 10  # refused under the default cap
