"""Every draft of a rollout laid out for ONE verification forward (`DraftTree`), and the scoring of its nodes
under the current sampling distribution (`score_nodes`); used by bitrl.rollout.reuse."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitrl.kernels.fused_logprobs import default_chunk_size
from bitrl.rollout.settings import Sampling

# A segment is a prompt followed by the prefix tree of some of its drafts. The verification mask costs
# rows x columns^2 booleans, so a prompt's drafts start a new segment once its tree would pass this many
# columns (a single draft longer than that still gets a segment of its own).
MAX_SEGMENT_COLUMNS = 2048


@dataclass
class DraftTree:
    """Every draft of a rollout, laid out for ONE verification forward.

    The drafts of each distinct prompt are merged into a prefix tree (the G samples of a group often share
    their first tokens or their whole response; each shared prefix is scored once). A prompt followed by
    its tree is a segment (a prompt whose tree would pass `max_columns` gets several); segments are packed,
    longest first, into rows no longer than the longest segment, so the forward carries little padding. A
    node attends to its segment's prompt, its ancestors and itself, at position prompt length + depth: its
    hidden state is what a plain forward over its own sequence gives.

    ids, position [R, C] int64: the packed rows (pad_id / 0 in padding); segment [R, C] int64: the segment
    of each column (-1 in padding); parent [R, C] int64: the column of a node's parent node (-1 for prompt
    tokens, first tokens and padding); is_node [R, C] bool.
    row, start, prompt_len, num_nodes [S] int64: where segment s lies, its prompt's length (its nodes
    follow the prompt) and its number of nodes.
    segment_of_row [B] int64: the segment holding row b's draft (or its prompt); path [B, D] int64: the node
    of each position of row b's draft within that segment (-1 past its end).
    """

    ids: torch.Tensor
    position: torch.Tensor
    segment: torch.Tensor
    parent: torch.Tensor
    is_node: torch.Tensor
    row: torch.Tensor
    start: torch.Tensor
    prompt_len: torch.Tensor
    num_nodes: torch.Tensor
    segment_of_row: torch.Tensor
    path: torch.Tensor

    @classmethod
    def build(
        cls,
        prompts: list[list[int]],
        prompt_of_row: list[int],
        drafts: list[list[int]],
        pad_id: int,
        device,
        max_columns: int | None = None,
    ):
        """prompts: the distinct prompts; prompt_of_row[b]: row b's prompt; drafts[b]: its draft tokens (may
        be empty). max_columns: None is MAX_SEGMENT_COLUMNS."""
        max_columns = MAX_SEGMENT_COLUMNS if max_columns is None else max_columns
        prompt_of: list[int] = []  # per segment
        index: list[dict] = []  # per segment: (parent node, token) -> node
        tokens: list[list[int]] = []
        parent: list[list[int]] = []
        depth: list[list[int]] = []
        open_segment: dict[int, int] = {}  # prompt -> the segment its next drafts go to
        segment_of_row, paths = [], []
        for u, draft in zip(prompt_of_row, drafts):
            s = open_segment.get(u)
            if s is not None and tokens[s]:
                shared, node = 0, -1  # how much of the draft the segment's tree already holds
                while shared < len(draft) and (node, draft[shared]) in index[s]:
                    node, shared = index[s][node, draft[shared]], shared + 1
                if len(prompts[u]) + len(tokens[s]) + len(draft) - shared > max_columns:
                    s = None
            if s is None:
                s = open_segment[u] = len(prompt_of)
                prompt_of.append(u)
                index.append({})
                tokens.append([])
                parent.append([])
                depth.append([])
            node, path = -1, []
            for token in draft:
                child = index[s].setdefault((node, token), len(tokens[s]))
                if child == len(tokens[s]):
                    tokens[s].append(token)
                    parent[s].append(node)
                    depth[s].append(len(path))
                node = child
                path.append(node)
            segment_of_row.append(s)
            paths.append(path)

        # first fit, longest segment first, into rows as long as the longest segment
        prompt_len = [len(prompts[u]) for u in prompt_of]
        length = [p + len(t) for p, t in zip(prompt_len, tokens)]
        width = max(length)
        used: list[int] = []
        row, start = [0] * len(length), [0] * len(length)
        for s in sorted(range(len(length)), key=lambda s: -length[s]):
            r = next((r for r, n in enumerate(used) if n + length[s] <= width), len(used))
            if r == len(used):
                used.append(0)
            row[s], start[s] = r, used[r]
            used[r] += length[s]

        ids, position = [[pad_id] * width for _ in used], [[0] * width for _ in used]
        segment, parent_col = [[-1] * width for _ in used], [[-1] * width for _ in used]
        is_node = torch.zeros((len(used), width), dtype=torch.bool)
        for s, u in enumerate(prompt_of):
            r, first, end = row[s], start[s] + prompt_len[s], start[s] + length[s]  # nodes: [first, end)
            ids[r][start[s] : end] = prompts[u] + tokens[s]
            position[r][start[s] : end] = [*range(prompt_len[s]), *(prompt_len[s] + d for d in depth[s])]
            segment[r][start[s] : end] = [s] * length[s]
            parent_col[r][first:end] = [first + q if q >= 0 else -1 for q in parent[s]]
            is_node[r, first:end] = True

        def tensor(x) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        width_d = max(len(p) for p in paths)
        return cls(
            ids=tensor(ids),
            position=tensor(position),
            segment=tensor(segment),
            parent=tensor(parent_col),
            is_node=is_node.to(device),
            row=tensor(row),
            start=tensor(start),
            prompt_len=tensor(prompt_len),
            num_nodes=tensor([len(t) for t in tokens]),
            segment_of_row=tensor(segment_of_row),
            path=tensor([p + [-1] * (width_d - len(p)) for p in paths]),
        )

    def attention(self) -> torch.Tensor:
        """[R, 1, C, C] bool, True where a query column may attend to a key column: within a segment, a
        prompt token attends to the prompt causally, a node to the whole prompt and to its ancestors and
        itself. Padding attends to itself only, so no row of the mask is empty (an empty row gives NaN)."""
        rows, width = self.ids.shape
        col = torch.arange(width, device=self.ids.device)
        same = (self.segment[:, :, None] == self.segment[:, None, :]) & (self.segment[:, None, :] >= 0)
        allowed = same & ~self.is_node[:, None, :] & (col[None, None, :] <= col[None, :, None])
        # ancestors-or-self of every node by pointer jumping, one level per step, as many steps as the
        # longest draft has tokens (column `width` collects finished chains)
        ancestors = torch.zeros((rows, width, width + 1), dtype=torch.bool, device=col.device)
        node = torch.where(self.is_node, col, -1)
        for _ in range(self.path.shape[1]):
            ancestors.scatter_(2, torch.where(node >= 0, node, width)[..., None], True)
            node = torch.where(node >= 0, self.parent.gather(1, node.clamp(min=0)), node)
        itself = torch.eye(width, dtype=torch.bool, device=col.device)
        return (allowed | ancestors[..., :width] | itself)[:, None]

    @property
    def first_node(self) -> torch.Tensor:
        """[S] int64: the column of each segment's node 0 (right after its prompt)."""
        return self.start + self.prompt_len

    def prediction_columns(self) -> torch.Tensor:
        """[S, N+1] int64: per segment, the column whose hidden state predicts a response's first token (its
        last prompt token), then the column of each node (predicting the token after it); padded with the
        first."""
        steps = torch.arange(int(self.num_nodes.max()) + 1, device=self.ids.device)[None, :]
        columns = self.first_node[:, None] - 1 + steps
        return torch.where(steps <= self.num_nodes[:, None], columns, columns[:, :1])

    def resume_attention(self, segments: torch.Tensor, path: torch.Tensor, width: int) -> torch.Tensor:
        """[A, width] int64 2D attention mask of resumed rows over the first `width` cache columns: their
        segment's prompt and the nodes on `path` [A, D] (-1 entries ignored). segments [A]: their segments."""
        col = torch.arange(width, device=path.device)[None, :]
        start, first = self.start[segments, None], self.first_node[segments, None]
        mask = ((col >= start) & (col < first)).long()
        on_path = torch.zeros((len(path), width + 1), dtype=torch.long, device=path.device)
        on_path.scatter_(1, torch.where(path >= 0, first + path, width), 1)  # column `width` takes the -1s
        return mask | on_path[:, :width]


def score_nodes(
    decoder,
    hidden: torch.Tensor,
    nodes: torch.Tensor,
    targets: torch.Tensor,
    sampling: Sampling,
    keep_topk: int = 0,
):
    """Log-prob of targets[b, i] under the sampling distribution predicted by hidden[nodes[b, i]], and with
    keep_topk = K > 0 that distribution's top-K, without a [B, D, V] tensor: the distinct nodes' logits are
    formed a chunk at a time (as bitrl.kernels.fused_logprobs tiles them) and dropped.

    hidden: [M, H] final hidden states; nodes, targets: [B, D] int64. Returns (logprobs [B, D] fp32, top:
    (ids [B*D, K] int64, logprobs [B*D, K] fp32) or None)."""
    flat_nodes, flat_targets = nodes.reshape(-1), targets.reshape(-1)
    logprobs = torch.zeros(flat_nodes.shape, dtype=torch.float32, device=hidden.device)
    k = keep_topk
    top = None
    if k:
        top = (
            torch.zeros((flat_nodes.numel(), k), dtype=torch.long, device=hidden.device),
            torch.full((flat_nodes.numel(), k), float("-inf"), device=hidden.device),
        )
    if flat_nodes.numel() == 0:
        return logprobs.view(nodes.shape), top
    unique, inverse = torch.unique(flat_nodes, return_inverse=True)
    chunk = default_chunk_size(decoder.model.config.vocab_size, hidden.device)
    for start in range(0, unique.numel(), chunk):
        logits = decoder.logits(hidden[unique[start : start + chunk]])
        logp = sampling.logprobs(logits)
        pick = ((inverse >= start) & (inverse < start + chunk)).nonzero().squeeze(-1)
        local = inverse[pick] - start
        logprobs[pick] = logp[local, flat_targets[pick]]
        if k:
            values, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
            top[0][pick, : ids.shape[1]], top[1][pick, : ids.shape[1]] = ids[local], values[local]
    return logprobs.view(nodes.shape), top
