"""The rollout engine: batched generation on one model with a preallocated KV cache (bitrl.rollout.decoder),
continuous batching and a decode step without host synchronisation (bitrl.rollout.decode_loop), and
counter-based fused sampling (bitrl.kernels.sampling).

    engine = RolloutEngine(model, Sampling(max_new_tokens=64, eos_id=eos, pad_id=pad), EngineOptions())
    rollout = engine.generate(prompts, generator=generator)

Sampling: one 64-bit step seed per call from `generator`; row seeds = sample_seeds(step seed, sample id) and
the counter is the response position, so a sample does not depend on the batch it runs in, its slot, the
admission order, max_batch_rows, world size or rank (pass global `sample_ids` from a data-parallel trainer).
"""

from __future__ import annotations

import torch

from bitrl.kernels.sampling import draw_step_seed, sample_seeds
from bitrl.rollout.batch import Rollout, distinct_prompts
from bitrl.rollout.decode_loop import Contexts, Outputs, compiled_next_tokens, decode, draw, next_tokens
from bitrl.rollout.decoder import Decoder, prefill
from bitrl.rollout.settings import EngineOptions, Sampling


def check_sample_ids(sample_ids, batch: int, device) -> torch.Tensor:
    if sample_ids is None:
        return torch.arange(batch, device=device)
    if (
        not isinstance(sample_ids, torch.Tensor)
        or sample_ids.shape != (batch,)
        or sample_ids.dtype != torch.long
    ):
        raise ValueError(
            f"sample_ids: expected a [{batch}] int64 tensor (one global id per prompt), got {sample_ids!r}"
        )
    return sample_ids.to(device)


class RolloutEngine:
    """Generation on `model` as `sampling` says, run as `options` say (default EngineOptions()).

    model: a Hugging Face causal LM of the Llama family (bitrl.rollout.decoder), any dtype, quantized linears
    included; the engine runs its modules in place, so weights synced into the model are the ones it samples
    from. It owns the model's `Decoder` and its decode step (eager, or compiled as options.compile says); the
    KV caches are allocated per call, sized by its prompts and max_new_tokens.
    """

    def __init__(self, model, sampling: Sampling, options: EngineOptions | None = None):
        self.model = model
        self.sampling = sampling
        self.options = options if options is not None else EngineOptions()
        device = model.get_input_embeddings().weight.device
        self.next_tokens = compiled_next_tokens(self.options, device)
        eager = self.next_tokens is next_tokens
        self.decoder = Decoder(model, aligned=self.options.aligned, packed=eager)

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    def generate(
        self,
        prompts: list[list[int]],
        *,
        generator: torch.Generator | None = None,
        sample_ids: torch.Tensor | None = None,
    ) -> Rollout:
        """Sample a response after each prompt (token lists). Repeated prompts are prefilled once. One
        64-bit seed is drawn from `generator` per call; sample_ids [B] int64 (default arange(B)) key each
        row's random numbers, so a row's sample does not depend on the batch it runs in."""
        ids = check_sample_ids(sample_ids, len(prompts), self.device)
        seeds = sample_seeds(draw_step_seed(generator), ids)
        return self.generate_rows(prompts, seeds, torch.zeros_like(seeds))

    @torch.no_grad()
    def generate_rows(
        self, prompts: list[list[int]], seeds: torch.Tensor, first_counter: torch.Tensor
    ) -> Rollout:
        """`generate` with explicit per-row sampling seeds [B] int64 and the sampling counter of each row's
        first response token first_counter [B] int64 (0 in `generate`; a response resumed at position i, as
        speculative reuse resumes one at its first rejection, counts from i)."""
        with self.decoder.packing():  # the products packed once for this rollout, freed after it
            return self._generate_rows(prompts, seeds, first_counter)

    def _generate_rows(self, prompts, seeds, first_counter) -> Rollout:
        options, device = self.options, self.device
        p_ids, p_mask, row_of = distinct_prompts(prompts, self.sampling.pad_id, device)
        distinct = [p[m].tolist() for p, m in zip(p_ids, p_mask)]
        cache, lengths, last_hidden = prefill(
            self.decoder, distinct, options.max_batch_rows, options.kv_cache_dtype
        )
        first_tok, first_lp = self.first_tokens(last_hidden, row_of, seeds, first_counter)
        col = torch.arange(cache.columns, device=device)
        ctx = Contexts(
            cache=cache,
            row=row_of,
            visible=col[None, :] < lengths[row_of, None],
            position=lengths[row_of],
            token=first_tok,
            counter=first_counter + 1,
            budget=torch.full_like(row_of, self.sampling.max_new_tokens - 1),
            seed=seeds,
        )
        ids, mask, lps, _, _ = self.continue_after_first(ctx, first_lp)
        return Rollout(p_ids[row_of], p_mask[row_of], ids, mask, lps)

    def first_tokens(self, hidden: torch.Tensor, rows: torch.Tensor, seeds, counter):
        """Sample each row's first token from hidden[rows[i]] (the LM head on at most max_batch_rows rows at
        once). Returns (tokens [N] int64, logprobs [N] fp32)."""
        toks, lps = [], []
        chunk = self.options.max_batch_rows
        for start in range(0, rows.shape[0], chunk):
            part = slice(start, start + chunk)
            logits = self.decoder.logits(hidden[rows[part]])
            tok, lp = draw(self.decoder, self.sampling, logits, seeds[part], counter[part])
            toks.append(tok)
            lps.append(lp)
        return torch.cat(toks), torch.cat(lps)

    def continue_after_first(self, ctx: Contexts, first_lp: torch.Tensor, first_top=None):
        """Responses = each sample's first token (ctx.token, already drawn, log-prob first_lp [N]) followed by
        its decoded continuation (samples whose first token is EOS or whose budget is 0 stop there).
        first_top: the first tokens' top-K (ids, logprobs) [N, K], or None; given, the continuation records
        its top-K too. Returns (response_ids [N, W] int64, response_mask [N, W] bool, logprobs [N, W] fp32,
        top: (ids, logprobs) [N, W, K] or None, decode steps run), W = the longest response."""
        sampling, device = self.sampling, self.device
        keep_topk = 0 if first_top is None else first_top[0].shape[-1]
        n = ctx.token.shape[0]
        rows = ((ctx.token != sampling.eos_id) & (ctx.budget > 0)).nonzero().squeeze(-1)
        full = Outputs.empty(n, max(int(ctx.budget.max()), 1), keep_topk, device).without_spare()
        steps = 0
        if rows.numel():
            out, steps = decode(
                self.decoder, ctx.subset(rows), sampling, self.options, self.next_tokens, keep_topk
            )
            width = out.tokens.shape[1]
            for name, value in out.__dict__.items():
                if value is not None:
                    target = getattr(full, name)
                    if value.dim() == 1:
                        target[rows] = value
                    else:
                        target[rows, :width] = value
        total = full.lengths + 1
        width = int(total.max())
        mask = torch.arange(width, device=device)[None, :] < total[:, None]

        def splice(first, rest, fill):
            joined = torch.cat([first[:, None], rest], dim=1)[:, :width]
            return joined.masked_fill(~mask.view(*mask.shape, *([1] * (joined.dim() - 2))), fill)

        ids = splice(ctx.token, full.tokens, sampling.pad_id)
        lps = splice(first_lp, full.logprobs, 0.0)
        top = None
        if keep_topk:
            top = (
                splice(first_top[0], full.top_ids, 0),
                splice(first_top[1], full.top_logprobs, float("-inf")),
            )
        return ids, mask, lps, top, steps
