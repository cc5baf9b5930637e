"""The `bitrl` command: one subcommand per job, each imported only when used."""

import importlib
import sys

# subcommand -> (module, function, one-line help). Modules are imported lazily so that
# `bitrl --help` stays fast and GPU-only dependencies are never touched on the CPU path.
COMMANDS = {
    "train": ("bitrl.engine.train_cmd", "main", "run RL training (default: the embedded demo)"),
    "bench": ("bitrl.kernels.bench", "main", "kernel microbenchmarks"),
    "mismatch": ("bitrl.engine.mismatch_cmd", "main", "rollout vs trainer log-prob mismatch diagnostics"),
    "quant-report": ("bitrl.quant.report", "main", "quantization error report per layer"),
    "export": (
        "bitrl.engine.export",
        "main",
        "save a run's policy as a Hugging Face directory (LoRA merged)",
    ),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: bitrl <command> [args]\n\ncommands:")
        for name, (_, _, help_text) in COMMANDS.items():
            print(f"  {name:<14}{help_text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"bitrl: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)
