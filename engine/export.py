"""`bitrl export RUN_DIR --out DIR`: a run's trained policy as a Hugging Face directory (LoRA merged) that
`AutoModelForCausalLM.from_pretrained(DIR)` loads, with its tokenizer."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bitrl.engine.config import ConfigError, load_config


def export_run(run_dir: str | Path, out: str | Path, log=print) -> Path:
    """Rebuild the policy of `run_dir` from its config and checkpoint, merge its LoRA adapters (a quantized
    base is dequantized), and save it in model.dtype with its tokenizer to `out`. Returns `out`."""
    import torch

    from bitrl.engine.loop import build, prepare_policy
    from bitrl.engine.models import DTYPES
    from bitrl.engine.warmstart import warm_start
    from bitrl.rollout.lora_merge import has_lora, merge_lora
    from bitrl.train.checkpoint import load_checkpoint, load_policy_state

    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"{run_dir} holds no config.json; is it a bitrl run directory?")
    where = [f"out_dir={json.dumps(str(run_dir.parent))}", f"name={json.dumps(run_dir.name)}", "device=cpu"]
    cfg = load_config(run_dir / "config.json", where)
    try:
        state = load_checkpoint(run_dir)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    policy, tokenizer, task = build(cfg)
    if cfg.model.lora.rank:  # the adapters sit on the warm-started model (cached), as in training
        warm_start(policy, tokenizer, task, cfg, log=log)
    policy = prepare_policy(policy, cfg, tokenizer, task, log)
    dtype = DTYPES[cfg.model.dtype]
    with torch.no_grad():
        for p in policy.parameters():  # the checkpoint holds fp32 master weights of what was trained
            if p.requires_grad:
                p.data = p.data.float()
        load_policy_state(policy, state["policy"])
    policy = merge_lora(policy, dtype) if has_lora(policy) else policy
    policy.to(dtype).eval()
    for p in policy.parameters():
        p.requires_grad_(False)
    out.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log(f"exported {run_dir} (step {state['step']}) to {out}")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="bitrl export", description="save a run's policy as a Hugging Face directory (LoRA merged)"
    )
    parser.add_argument("run", metavar="RUN_DIR", help="a bitrl run directory (config.json + checkpoint.pt)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    args = parser.parse_args(argv)
    try:
        export_run(args.run, args.out)
    except ConfigError as e:
        print(f"bitrl export: {e}", file=sys.stderr)
        return 2
    return 0
