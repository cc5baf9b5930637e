"""Bias of speculative reuse: total-variation distance between reused and fresh sampling, computed exactly.

A tiny random Qwen2 (vocabulary of 5 tokens, all samplable, eos among them; responses of at most 3 tokens, so
85 possible responses) is the old policy; the new policy is the same model with Gaussian noise of std sigma
added to every weight. For each mode, stored old-distribution size and lenience the script prints the exact
TV between the response distribution of "draft from old, verify and resume with new" and fresh sampling from
new, the expected number of accepted draft tokens and the probability that a draft is fully reused; then it
checks the engine's empirical distribution against the formula (TV at the sampling-noise floor).

    python benchmarks/bench_reuse_tv.py [--samples 40000]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

V, LEN, EOS = 5, 3, 2
LENIENCES = [0.5, 1.0, math.exp(0.5), 2.0, 4.0]
MODES = [("spec-rl", 0), ("exact", V), ("exact", 1), ("exact", 0)]


def main(argv=None) -> int:
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.settings import Sampling
    from bitrl.tests import reuse_tv as tv  # the exact formulas, shared with tests/test_reuse.py

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=40000)
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.05, 0.2])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    prompt = [1, 3]
    old = tv.enumerable_model(V, EOS)
    t_old = tv.next_token_table(old, prompt, vocab_size=V, max_new_tokens=LEN, eos_id=EOS)
    seqs = tv.sequences(t_old, V, LEN, EOS)
    p_old = tv.fresh_distribution(t_old, seqs)
    for sigma in args.sigmas:
        new = tv.perturbed(old, sigma)
        t_new = tv.next_token_table(new, prompt, vocab_size=V, max_new_tokens=LEN, eos_id=EOS)
        p_new = tv.fresh_distribution(t_new, seqs)
        print(
            f"\n### sigma = {sigma}: TV(old, new) = {tv.total_variation(p_old, p_new):.4f} "
            "(reuse without verifying)"
        )
        print("\n| mode | old distribution kept | " + " | ".join(f"l = {x:.3g}" for x in LENIENCES) + " |")
        print("| --- | --- | " + " | ".join("---" for _ in LENIENCES) + " |")
        summaries = {}
        for mode, k in MODES:
            cells = []
            for lenience in LENIENCES:
                dist, summary = tv.reuse_distribution(
                    t_new, t_old, seqs, lenience=lenience, mode=mode, old_topk=k
                )
                cells.append(f"{tv.total_variation(dist, p_new):.4f}")
                summaries[lenience] = summary
            kept = "-" if mode == "spec-rl" else ("full" if k >= V else f"top-{k} + drafted token")
            kept = "drafted token only" if mode == "exact" and k == 0 else kept
            print(f"| {mode} | {kept} | " + " | ".join(cells) + " |")
        print(
            "| accepted draft tokens (mean) | | "
            + " | ".join(f"{summaries[x]['accepted_tokens']:.3f}" for x in LENIENCES)
            + " |"
        )
        print(
            "| drafts fully reused | | "
            + " | ".join(f"{summaries[x]['fully_reused']:.3f}" for x in LENIENCES)
            + " |"
        )
        n = args.samples
        engine = RolloutEngine(new, Sampling(max_new_tokens=LEN, eos_id=EOS, pad_id=0))
        floor = engine.generate([prompt] * n, generator=torch.Generator().manual_seed(9))
        print(
            f"\nengine check, {n} samples at l = 1 (noise floor: fresh samples vs exact "
            f"{tv.total_variation(tv.empirical_distribution(floor), p_new):.4f})"
        )
        for mode, k in [("spec-rl", 0), ("exact", V)]:
            setup = (old, new, prompt, t_old, t_new, seqs)
            emp, dist = tv.engine_against_formula(
                setup, n, mode=mode, old_topk=k, max_new_tokens=LEN, eos_id=EOS
            )
            print(
                f"- {mode}: TV(engine, formula) = {tv.total_variation(emp, dist):.4f}, "
                f"TV(engine, fresh exact) = {tv.total_variation(emp, p_new):.4f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
