"""`bitrl train [--config FILE | --preset NAME] [--resume RUN_DIR] [--nproc N] [--force] [key=value ...]`

Runs one RL training run; `key=value` overrides are dotted config fields (section.key=value).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bitrl.engine.config import ConfigError, load_config

PRESETS = Path(__file__).parent / "presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def preset_path(name: str) -> Path:
    """The YAML file of a preset shipped with bitrl (engine/presets/NAME.yaml)."""
    path = PRESETS / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"--preset: no preset {name!r}; choose from {', '.join(preset_names())}")
    return path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="bitrl train", description="RL training; defaults are the embedded demo"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", help="YAML or JSON config file")
    source.add_argument("--preset", help=f"a config shipped with bitrl: {', '.join(preset_names())}")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run saved in RUN_DIR")
    parser.add_argument("--force", action="store_true", help="run even if the memory plan is over 95%%")
    parser.add_argument(
        "--nproc", type=int, default=1, help="data-parallel ranks on this machine (spawns torchrun)"
    )
    parser.add_argument(
        "overrides", nargs="*", help="section.key=value, e.g. train.lr=5e-4 rollout.group_size=4"
    )
    args = parser.parse_args(argv)
    try:
        if args.resume:
            run_dir = Path(args.resume)
            config_file = run_dir / "config.json"
            if not config_file.is_file():
                raise ConfigError(f"--resume: {run_dir} holds no config.json; is it a bitrl run directory?")
            where = [f"out_dir={json.dumps(str(run_dir.parent))}", f"name={json.dumps(run_dir.name)}"]
            cfg = load_config(config_file, [*args.overrides, *where])
        else:
            cfg = load_config(preset_path(args.preset) if args.preset else args.config, args.overrides)
    except ConfigError as e:
        print(f"bitrl train: {e}", file=sys.stderr)
        return 2

    from bitrl.engine.launch import launch, under_torchrun
    from bitrl.train.checkpoint import check_resume_world_size
    from bitrl.train.distributed import rank_groups

    if args.nproc < 1:
        print(f"bitrl train: --nproc must be >= 1, got {args.nproc}", file=sys.stderr)
        return 2
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
    try:
        r = cfg.rollout
        rank_groups(r.prompts_per_step, 0, world_size, r.group_size, cfg.train.minibatches)
        if args.resume:
            check_resume_world_size(Path(args.resume), world_size)
    except ValueError as e:
        print(f"bitrl train: {e}", file=sys.stderr)
        return 2
    if args.nproc > 1 and not under_torchrun():
        return launch(args.nproc, argv)  # every rank runs this command again, under torchrun

    from bitrl.engine.loop import run, summarize
    from bitrl.engine.tasks import InputError

    t0 = time.perf_counter()
    try:
        records = run(cfg, resume=bool(args.resume), force=args.force)
    # bad data or model files (found before any weights load), a plan over memory, or a setting the model
    # cannot take
    except (ConfigError, InputError) as e:
        print(f"bitrl train: {e}", file=sys.stderr)
        return 2
    summary = summarize(records) | {"wall_time_s": round(time.perf_counter() - t0, 1)}
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary))
        print(f"metrics: {cfg.run_dir / 'metrics.jsonl'}  report: {cfg.run_dir / 'report.png'}")
    return 0
