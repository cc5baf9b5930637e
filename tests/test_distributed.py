"""Data-parallel training on CPU (gloo): torchrun spawns 2 ranks from inside pytest.

The worker half of this file (`python -m torch.distributed.run ... tests/test_distributed.py trainer OUT`)
runs on each rank; the tests compare what it writes with the single-process run in the pytest process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TRAIN_CFG, assert_same_adam_update

from bitrl.engine.config import LoraConfig, TrainConfig

REPO = Path(__file__).resolve().parents[1]
GROUPS, GROUP_SIZE = 4, 2
# two optimizer steps per pass: each rank's k-th minibatch is every 2nd of its rows
# AIS: its lambda comes from statistics of the whole batch, summed over the ranks
VARIANTS = {
    "minibatches": TRAIN_CFG | {"minibatches": 2},
    "ais": TRAIN_CFG | {"loss": {"correction": "ais", "ais_kl_scale": 0.05}},
}
LORA = LoraConfig(rank=4, alpha=8.0)


def tiny_policy(seed: int = 0):
    from conftest import TINY_QWEN, make_qwen

    return make_qwen(seed, **TINY_QWEN).train()


def global_batch(policy):
    """GROUPS prompts of different lengths, GROUP_SIZE samples each, and per-sample advantages."""
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.settings import Sampling

    prompts = [[1, 5 + g] + [7] * g for g in range(GROUPS) for _ in range(GROUP_SIZE)]
    generator = torch.Generator().manual_seed(1)
    engine = RolloutEngine(policy, Sampling(max_new_tokens=6, eos_id=2, pad_id=0))
    rollout = engine.generate(prompts, generator=generator)
    advantages = torch.randn(len(prompts), generator=generator)
    return rollout, advantages


def mismatched(rollout):
    """The rollout with its log-probs perturbed, as if a low-precision copy had sampled it."""
    noise = 0.3 * torch.randn(rollout.logprobs.shape, generator=torch.Generator().manual_seed(2))
    return dataclasses.replace(rollout, logprobs=rollout.logprobs + noise * rollout.response_mask)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def subprocess_env(**extra: str) -> dict:
    """The environment of a test's ranks, read when they start: it carries the test's own bitrl cache (an
    environment read at import would send the ranks' warm starts to the user's cache, and load there what
    another machine's kernels, or an older run, left)."""
    # the ranks run this file as a script and import conftest beside it; PYTHONSAFEPATH (conftest) keeps a
    # script's folder off sys.path, so it is named here
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **extra}


def torchrun(*args: str, nproc: int = 2, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TORCHRUN, f"--nproc-per-node={nproc}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env() if env is None else env,
        cwd=REPO,
    )


def tiny_run_args(out_dir: Path, name: str) -> list[str]:
    """`bitrl train` overrides for a few RL steps of a one-layer demo model on one-digit sums, warm-started to
    about 30% accuracy so that groups carry a learning signal."""
    return [
        f"out_dir={out_dir}",
        f"name={name}",
        "steps=6",
        "eval_every=3",
        "checkpoint_every=2",
        "threads=1",
        "task.digits=1",
        "task.n_eval=16",
        "warmstart.steps=100",
        "warmstart.lr=3e-3",
        "warmstart.eval_every=50",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_layers=1",
        "model.num_heads=2",
        "model.num_kv_heads=1",
    ]


def metrics_without_timings(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith(("_time_s", "tokens_per_s"))} for r in rows]


def descendant_with_env(pid: int, variable: str) -> int | None:
    """The pid of a descendant process of `pid` whose environment holds `variable` (e.g. RANK=1)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            if variable.encode() in (Path("/proc") / str(child) / "environ").read_bytes().split(b"\0"):
                return child
        except OSError:
            pass
        todo.extend(children.get(child, []))
    return None


# ------------------------------------------------------------------------------------------------ worker


def worker_trainer(out: Path) -> None:
    """On every rank: shard the policy, take one RL step on this rank's groups, then check weight sync and a
    checkpoint round trip; rank 0 writes the gathered parameters (plain, with gradient checkpointing, and LoRA
    adapters)."""
    import torch.distributed as dist

    from bitrl.quant import quantize
    from bitrl.quant.linear import QuantLinear
    from bitrl.rollout.lora_merge import lora_layers, merged_weight
    from bitrl.rollout.precision import make_rollout_model
    from bitrl.train.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
    from bitrl.train.distributed import (
        full_tensor,
        init_distributed,
        is_sharded,
        rank_groups,
        sync_rollout_model_sharded_,
    )
    from bitrl.train.lora import apply_lora
    from bitrl.train.trainer import PolicyTrainer, rollout_rows

    torch.set_num_threads(1)
    ctx = init_distributed(torch.device("cpu"))
    rollout, advantages = global_batch(tiny_policy())
    groups = rank_groups(GROUPS, ctx.rank, ctx.world_size)
    rows = torch.arange(groups.start * GROUP_SIZE, groups.stop * GROUP_SIZE)
    gathered = {}
    for variant in ("lora", "plain", "minibatches", "ais", "checkpointing"):
        policy = apply_lora(tiny_policy(), LORA) if variant == "lora" else tiny_policy()
        copies = {p: make_rollout_model(policy, p) for p in ("full", "mxfp4")}
        checkpointing = variant == "checkpointing"
        cfg = TrainConfig(**VARIANTS.get(variant, TRAIN_CFG), gradient_checkpointing=checkpointing)
        trainer = PolicyTrainer(policy, cfg)  # shards the policy: this process is one of 2 ranks
        assert is_sharded(policy)
        batch = mismatched(rollout) if variant == "ais" else rollout
        metrics = trainer.step(rollout_rows(batch, rows), advantages[rows])
        gathered[variant] = {n: full_tensor(p.detach()).clone() for n, p in policy.named_parameters()}
        gathered[variant + "_metrics"] = metrics
        if variant == "lora":  # each rank's copy holds W + (alpha / r) B A of the gathered adapters
            reference = apply_lora(tiny_policy(), LORA)
            reference.load_state_dict(gathered["lora"])
            for precision, rollout_model in copies.items():
                sync_rollout_model_sharded_(rollout_model, policy)
                for name, layer in lora_layers(reference).items():
                    target = rollout_model.get_submodule(name)
                    if isinstance(target, QuantLinear):
                        want = QuantLinear(  # the same recipe: scales, outlier fallback
                            target.in_features,
                            target.out_features,
                            fmt=target.fmt,
                            act=target.act,
                            quant_kwargs=target.quant_kwargs,
                            outlier_tau=target.outlier_tau,
                        )
                        want.set_weight(merged_weight(layer, torch.float32))
                        assert torch.equal(target.qdata, want.qdata), f"lora {precision} {name}"
                    else:
                        assert torch.equal(target.weight, merged_weight(layer, torch.float32)), f"lora {name}"

    # weight sync: every rank's copy equals the gathered weights (or their quantization), bit for bit
    weights = gathered["checkpointing"]
    for precision, rollout_model in copies.items():
        sync_rollout_model_sharded_(rollout_model, policy)
        for name, module in rollout_model.named_modules():
            if isinstance(module, QuantLinear):
                expect = quantize(weights[name + ".weight"], module.fmt, **module.quant_kwargs)
                assert torch.equal(module.qdata, expect.data), f"{precision} {name}: qdata differs"
                assert torch.equal(module.qscale, expect.scale), f"{precision} {name}: scales differ"
        for name, param in rollout_model.named_parameters():
            assert torch.equal(param, weights[name]), f"{precision} rank {ctx.rank}: {name} differs"

    # sharded checkpoint: save, take another step, load: parameters and optimizer states come back exactly
    def snapshot():
        optim = [full_tensor(t).clone() for s in trainer.optimizer.state.values() for t in s.values()]
        return [full_tensor(p.detach()).clone() for p in policy.parameters()] + optim

    save_sharded_checkpoint(out / "run", 1, policy, trainer.optimizer, {"rank": ctx.rank})
    saved = snapshot()
    trainer.step(rollout_rows(rollout, rows), advantages[rows])
    assert not all(torch.equal(a, b) for a, b in zip(saved, snapshot())), "the second step changed nothing"
    assert load_sharded_checkpoint(out / "run", policy, trainer.optimizer) == {"rank": ctx.rank}
    for a, b in zip(saved, snapshot(), strict=True):
        assert torch.equal(a, b), "a parameter or optimizer state differs after the checkpoint round trip"

    if ctx.is_main:
        torch.save(gathered, out / "gathered.pt")
    dist.destroy_process_group()


# A 25M-parameter demo model (fp32 weights, gradients and AdamW states: 384 MiB on one rank), 2 RL steps.
BUDGET_RUN = [
    "model.hidden_size=512",
    "model.intermediate_size=1536",
    "model.num_layers=8",
    "model.num_heads=8",
    "model.num_kv_heads=4",
    "steps=2",
    "threads=1",
    "warmstart.steps=0",
    "task.n_eval=8",
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
]
# Each rank's budget for what the run allocates: measured growth of the data segment 571 MiB on one rank,
# 393 MiB on each of two (the sharded states halve; the rollout copy and activations stay per rank).
BUDGET_MIB = 480


def worker_budget(out: Path) -> None:
    """On every rank: cap what this process may allocate from now on at BUDGET_MIB above what it holds (the
    kernel enforces RLIMIT_DATA on every private writable mapping: torch's tensors, malloc's heap), then run
    `bitrl train`. An allocation over the budget fails with ENOMEM and the rank dies."""
    import resource

    from bitrl.engine.config import load_config
    from bitrl.engine.loop import model_config, run
    from bitrl.train.distributed import init_distributed

    cfg = load_config(None, [f"out_dir={out}", "name=budget", *BUDGET_RUN])
    init_distributed(torch.device("cpu"))
    model_config(cfg)  # the model's code imported before the budget starts
    status = Path("/proc/self/status").read_text().splitlines()
    data = next(int(line.split()[1]) for line in status if line.startswith("VmData:")) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (data + BUDGET_MIB * 2**20, resource.RLIM_INFINITY))
    run(cfg, log=lambda *a, **k: None)


# ------------------------------------------------------------------------------------------------- tests


def test_rank_groups_are_whole_groups_in_rank_order():
    from bitrl.train.distributed import rank_groups, sample_ids

    for world in (1, 2, 4):
        shares = [rank_groups(8, r, world) for r in range(world)]
        assert [g for s in shares for g in s] == list(range(8))
        ids = torch.cat([sample_ids(s, 3) for s in shares])
        assert torch.equal(ids, torch.arange(24))  # every sample once, rank by rank, groups never split
        assert all(set((sample_ids(s, 3) // 3).tolist()) == set(s) for s in shares)
    with pytest.raises(ValueError, match="prompts_per_step .6. must divide by the world size .4."):
        rank_groups(6, 0, 4)


def test_launch_command_and_bad_world_sizes(capsys):
    from bitrl.engine.launch import torchrun_command, without_nproc
    from bitrl.engine.train_cmd import main

    args = ["--nproc", "2", "steps=3", "--nproc=2", "--resume", "runs/x"]
    cmd = torchrun_command(2, without_nproc(args))
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "bitrl"] + [
        "train",
        "steps=3",
        "--resume",
        "runs/x",
    ]
    # refused before anything is spawned, with the setting to change
    assert main(["--nproc", "3", "rollout.prompts_per_step=4"]) == 2
    assert "rollout.prompts_per_step (4) must divide by the world size (3)" in capsys.readouterr().err
    uneven = ["rollout.prompts_per_step=2", "rollout.group_size=3", "train.minibatches=2"]
    assert main(["--nproc", "2", *uneven]) == 2
    assert "train.minibatches (2) must divide each rank's rows (1 groups x 3" in capsys.readouterr().err
    assert main(["--nproc", "0"]) == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err
    assert main(["train.fsdp_mixed_precision=fp8"]) == 2
    assert "train.fsdp_mixed_precision" in capsys.readouterr().err


def test_two_ranks_step_equals_one_rank(tmp_path):
    """fp32: one step on 2 ranks (FSDP2, each on its own groups) gives the single-process parameters within
    1e-5 relative, with and without gradient checkpointing, in two minibatches, with AIS, and with LoRA
    adapters; weight sync and the checkpoint round trip are checked on each rank inside the worker."""
    from bitrl.train.lora import apply_lora
    from bitrl.train.trainer import PolicyTrainer

    result = torchrun(__file__, "trainer", str(tmp_path))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    gathered = torch.load(tmp_path / "gathered.pt")

    rollout, advantages = global_batch(tiny_policy())
    one_rank = {}
    for variant, policy in (
        ("plain", tiny_policy()),
        ("lora", apply_lora(tiny_policy(), LORA)),
        ("minibatches", tiny_policy()),
        ("ais", tiny_policy()),
    ):
        cfg = TrainConfig(**VARIANTS.get(variant, TRAIN_CFG))
        batch = mismatched(rollout) if variant == "ais" else rollout
        metrics = PolicyTrainer(policy, cfg).step(batch, advantages)
        one_rank[variant] = (policy, metrics)
    one_rank["checkpointing"] = one_rank["plain"]  # the same update, activations recomputed
    for variant, (policy, metrics) in one_rank.items():
        # Two ranks sum the gradient in another order (k_proj's bias has an exactly zero gradient in exact
        # arithmetic; the final norm's weight moved 4e-5 = 0.4% of a step in two minibatch steps after a
        # change of exp's last bits).
        got = torch.cat([gathered[variant][n].flatten() for n, _ in policy.named_parameters()])
        want = torch.cat([p.detach().flatten() for p in policy.parameters()])
        assert_same_adam_update(got, want, TRAIN_CFG["lr"], variant)
        got = gathered[variant + "_metrics"]
        for key in ("loss", "grad_norm", "entropy", "mismatch_k1_kl", "mismatch_max_abs_dp"):
            assert got[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
        if variant == "ais":  # a real correction: lambda well inside (0, 1)
            assert 0.05 < metrics["ais_lambda"] < 0.95
            assert got["ais_lambda"] == pytest.approx(metrics["ais_lambda"], rel=1e-5)


def test_two_ranks_aligned_read_their_rollouts_bits_and_step_like_one_rank(tmp_path):
    """rollout.aligned with FSDP2 on 2 ranks: each rank's sharded trainer gives its rollout's log-probs bit
    for bit (every layer's weights gathered around its aligned computation), and the step's loss, gradient
    norm and entropy are the one-rank step's."""
    from bitrl.train.trainer import PolicyTrainer

    result = torchrun(__file__, "aligned", str(tmp_path))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"aligned-{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["old_equals_rollout"] and rank["tokens"] > 4
        assert rank["metrics"]["mismatch_k3_kl"] == 0.0 and rank["metrics"]["mismatch_max_abs_dp"] == 0.0
    policy = aligned_policy()
    rollout = aligned_rollout(policy, 0, 1)
    metrics = PolicyTrainer(policy, TrainConfig(**TRAIN_CFG), aligned=True).step(rollout, ALIGNED_ADVANTAGES)
    assert metrics["mismatch_k3_kl"] == 0.0
    for key in ("loss", "grad_norm", "entropy"):
        assert ranks[0]["metrics"][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_DATA caps anonymous mappings on Linux only")
def test_a_model_over_one_ranks_memory_budget_trains_on_two(tmp_path):
    """With each rank's allocations capped at BUDGET_MIB by the kernel, the 25M-parameter model runs out of
    memory on one rank and trains its 2 steps on two (FSDP2 shards weights, gradients and AdamW states)."""
    # Freed tensors above 64 KiB go back to the system at once, so the cap meets live memory, not a cache.
    env = subprocess_env(MALLOC_MMAP_THRESHOLD_="65536")
    one = torchrun(__file__, "budget", str(tmp_path / "one"), nproc=1, env=env)
    assert one.returncode != 0 and "can't allocate memory" in one.stderr, one.stderr[-3000:]
    two = torchrun(__file__, "budget", str(tmp_path / "two"), nproc=2, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "two/budget/metrics.jsonl").open()]
    assert steps == [0, 1, 2]


def test_two_ranks_run_like_one_and_resume_after_sigkill(tmp_path):
    """An uninterrupted run on 2 ranks (plain torchrun) has the single-process run's metrics (sampling keyed
    by sample id, whole groups per rank, global normalisers); a run (`bitrl train --nproc 2`) whose rank 1
    is SIGKILLed after its first checkpoint, then resumed, has the uninterrupted run's metrics exactly."""
    from bitrl.engine.config import load_config
    from bitrl.engine.loop import run as train

    full = torchrun("-m", "bitrl", "train", *tiny_run_args(tmp_path, "full"))
    assert full.returncode == 0, full.stderr[-4000:]
    two_ranks = metrics_without_timings(tmp_path / "full")
    train(load_config(None, tiny_run_args(tmp_path, "one")), log=lambda *a: None)
    one_rank = metrics_without_timings(tmp_path / "one")
    assert [r["step"] for r in two_ranks] == [r["step"] for r in one_rank] == list(range(7))
    assert any(r.get("reward_mean", 0) > 0 for r in one_rank) and any(r.get("loss", 0) for r in one_rank)
    for a, b in zip(two_ranks, one_rank):
        assert a.keys() == b.keys()
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6), a["step"]

    bitrl = [sys.executable, "-m", "bitrl", "train", "--nproc", "2"]
    killed_dir = tmp_path / "killed"
    log = open(tmp_path / "killed.log", "w")  # noqa: SIM115 (open while the run lasts)
    run = subprocess.Popen(
        [*bitrl, *tiny_run_args(tmp_path, "killed")], env=subprocess_env(), cwd=REPO, stderr=log, stdout=log
    )
    deadline = time.monotonic() + 240
    metrics = killed_dir / "metrics.jsonl"
    # kill between the first checkpoint (step 2) and the end (step 6)
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 4):  # step 0, 1, 2, 3
        assert run.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.02)
    rank1 = descendant_with_env(run.pid, "RANK=1")
    assert rank1 is not None, "rank 1's process not found"
    os.kill(rank1, signal.SIGKILL)
    assert run.wait(timeout=120) != 0
    log.close()
    assert (killed_dir / "checkpoint.json").is_file()
    wrong = subprocess.run(
        [*bitrl[:-2], "--resume", str(killed_dir)], env=subprocess_env(), capture_output=True, text=True
    )
    assert wrong.returncode == 2 and "saved by 2 ranks; resume it with --nproc 2" in wrong.stderr

    resumed = subprocess.run(
        [*bitrl, "--resume", str(killed_dir)],
        env=subprocess_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed" in resumed.stdout + resumed.stderr
    assert metrics_without_timings(killed_dir) == two_ranks


def worker_aligned(out: Path) -> None:
    """On every rank, rollout.aligned: an aligned rollout of this rank's groups by its unsharded copy, then
    the sharded trainer's old-log-prob pass and one step on them; writes what matched and the gradients'
    norm."""
    from bitrl.rollout.precision import make_rollout_model
    from bitrl.train.distributed import init_distributed, is_sharded
    from bitrl.train.trainer import PolicyTrainer

    torch.set_num_threads(1)
    ctx = init_distributed(torch.device("cpu"))
    policy = aligned_policy()
    rollout = aligned_rollout(make_rollout_model(policy, "full"), ctx.rank, ctx.world_size)
    trainer = PolicyTrainer(policy, TrainConfig(**TRAIN_CFG), aligned=True)
    assert is_sharded(policy)
    old = trainer.old_logprobs(rollout)
    m = rollout.response_mask
    metrics = trainer.step(rollout, ALIGNED_ADVANTAGES.chunk(ctx.world_size)[ctx.rank])
    result = {
        "old_equals_rollout": bool(torch.equal(old[m], rollout.logprobs[m])),
        "tokens": int(m.sum()),
        "metrics": metrics,
    }
    (out / f"aligned-{ctx.rank}.json").write_text(json.dumps(result))


ALIGNED_ADVANTAGES = torch.linspace(-1, 1, GROUPS * GROUP_SIZE)


def aligned_policy():
    """A tiny Qwen2 whose head_dim (16) the CPU attention kernel takes."""
    from conftest import TINY_QWEN, make_qwen

    return make_qwen(0, **(TINY_QWEN | {"num_attention_heads": 2, "num_key_value_heads": 1})).train()


def aligned_rollout(model, rank: int, world: int):
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.settings import EngineOptions, Sampling

    prompts = [[1, 5 + g] + [7] * g for g in range(GROUPS) for _ in range(GROUP_SIZE)]
    ids = torch.arange(len(prompts)).chunk(world)[rank]
    sampling = Sampling(max_new_tokens=6, eos_id=2, pad_id=0)
    engine = RolloutEngine(model, sampling, EngineOptions(aligned=True))
    generator = torch.Generator().manual_seed(1)
    return engine.generate([prompts[i] for i in ids], generator=generator, sample_ids=ids)


if __name__ == "__main__":
    workers = {"trainer": worker_trainer, "budget": worker_budget, "aligned": worker_aligned}
    workers[sys.argv[1]](Path(sys.argv[2]))
