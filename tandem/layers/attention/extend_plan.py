"""How the torch-native backend batches an EXTEND forward's attention into few SDPA calls.

Requests of similar sizes form a group attended by one SDPA call over a padded block:
queries [g, n_max] and keys [g, L_max] (n: the request's new tokens, L: its KV length).
Query j of request i sits at absolute position prefix_i + j and sees keys 0..prefix_i + j,
so padded keys (past seq_len_i, read from slot 0, the zeroed padding slot) are never seen
by a real query, and padded query rows are dropped. A group with no cached prefix is
plain causal attention (SDPA's `is_causal`, no mask); otherwise a boolean mask is built
here, once per forward. A group is grown, over the requests sorted by size, while its
padded block costs at most 1.25x the attention it holds (`MAX_PADDED_WASTE`), so a batch
of similar prompts is one call and very uneven ones fall back towards one call each.

One call instead of one per request matters most on a loaded CPU: each PyTorch op opens
a parallel region, and a per-request loop of small ops waits on every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.forward_batch import ForwardBatch

MAX_PADDED_WASTE = 1.25


@dataclass
class ExtendGroup:
    """Requests attended by one SDPA call, padded to `num_queries` x `num_keys`."""

    size: int  # requests in the group
    num_queries: int  # n_max
    num_keys: int  # L_max
    slots: torch.Tensor  # [size * num_keys] KV slot per (request, key position); 0 past the end
    query_index: torch.Tensor | None  # [size * num_queries] token of q per padded row; None: q itself
    mask: torch.Tensor | None  # [size, 1, num_queries, num_keys] bool; None: causal, no prefix
    prefix: torch.Tensor | None = None  # [size] cached prefix length of each request (host)
    _stacked_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int) -> torch.Tensor:
        """[size, 1, num_queries, num_keys] bool on the slots' device: query j of request i
        (position prefix_i + j) sees the keys at (prefix_i + j - window, prefix_i + j], or
        all of 0..prefix_i + j when `window` is 0 (built by the first layer, reused)."""
        if window not in self._window_masks:
            qpos = self.prefix.view(-1, 1, 1) + torch.arange(self.num_queries).view(1, -1, 1)
            kpos = torch.arange(self.num_keys).view(1, 1, -1)
            mask = kpos <= qpos
            if window > 0:
                mask &= kpos > qpos - window
            self._window_masks[window] = mask.unsqueeze(1).to(self.slots.device)
        return self._window_masks[window]

    def stacked_mask(self, group_heads: int) -> torch.Tensor:
        """`mask` for `group_heads` query heads stacked on the query axis, head-major:
        [size, 1, group_heads * num_queries, num_keys] (built by the first layer, reused)."""
        if group_heads not in self._stacked_masks:
            size, _, n, kv_len = self.mask.shape
            self._stacked_masks[group_heads] = self.mask.expand(size, group_heads, n, kv_len).reshape(
                size, 1, group_heads * n, kv_len
            )
        return self._stacked_masks[group_heads]


def slot_table(
    req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[len(rows), max_len] KV slots of each request's row (slot 0, the zeroed padding slot,
    past its `seq_lens`), and the validity mask; on `seq_lens`' device."""
    valid = torch.arange(max_len, device=seq_lens.device).unsqueeze(0) < seq_lens.unsqueeze(1)
    return req_to_token[rows, :max_len].masked_fill(~valid, 0), valid


@dataclass
class ExtendPlan:
    groups: list[ExtendGroup]
    # [num_tokens] row of each token in the groups' padded outputs, concatenated; None: the
    # concatenation is already the output (one group, no padding, batch order).
    output_index: torch.Tensor | None


def _group_requests(extend_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Requests (indices) by group: sorted by (new tokens, KV length), each group grown
    while its padded cost stays within MAX_PADDED_WASTE of the real one."""
    order = sorted(range(len(extend_lens)), key=lambda i: (extend_lens[i], seq_lens[i]))
    groups: list[list[int]] = []
    n_max = l_max = real = 0
    for i in order:
        n, kv = extend_lens[i], seq_lens[i]
        if groups:
            size = len(groups[-1]) + 1
            cand_n, cand_l, cand_real = max(n_max, n), max(l_max, kv), real + n * kv
            if size * cand_n * cand_l <= MAX_PADDED_WASTE * cand_real:
                groups[-1].append(i)
                n_max, l_max, real = cand_n, cand_l, cand_real
                continue
        groups.append([i])
        n_max, l_max, real = n, kv, n * kv
    return groups


def plan_extend(fb: ForwardBatch, req_to_token: torch.Tensor) -> ExtendPlan:
    """The groups of an EXTEND batch and the index tensors every layer reuses (host math on
    the host lists, one copy of each index to the device)."""
    device = req_to_token.device
    extend_lens, seq_lens, prefix_lens = fb.extend_lens_cpu, fb.seq_lens_cpu, fb.prefix_lens_cpu
    starts = [0]
    for n in extend_lens[:-1]:
        starts.append(starts[-1] + n)
    rows_of = fb.req_pool_indices.tolist()
    groups: list[ExtendGroup] = []
    padded_row = [0] * len(extend_lens)  # first padded output row of each request
    offset = 0
    for members in _group_requests(extend_lens, seq_lens):
        n = torch.tensor([extend_lens[i] for i in members])
        kv = torch.tensor([seq_lens[i] for i in members])
        prefix = torch.tensor([prefix_lens[i] for i in members])
        start = torch.tensor([starts[i] for i in members])
        n_max, l_max = int(n.max()), int(kv.max())
        rows = torch.tensor([rows_of[i] for i in members], device=device)
        slots = slot_table(req_to_token, rows, kv.to(device), l_max)[0].reshape(-1)
        qpos = torch.arange(n_max)
        # Padded query rows repeat the request's last token (any real row would do).
        query_index = (start.unsqueeze(1) + torch.minimum(qpos.unsqueeze(0), n.unsqueeze(1) - 1)).reshape(-1)
        mask = None
        if int(prefix.max()) > 0:
            kpos = torch.arange(l_max)
            mask = (kpos.view(1, 1, -1) <= (prefix.view(-1, 1, 1) + qpos.view(1, -1, 1))).unsqueeze(1)
            mask = mask.to(device)
        for k, i in enumerate(members):
            padded_row[i] = offset + k * n_max
        offset += len(members) * n_max
        groups.append(ExtendGroup(len(members), n_max, l_max, slots, query_index, mask, prefix))
    lens = torch.tensor(extend_lens)
    token = torch.arange(int(lens.sum()))
    output_index = token + (torch.tensor(padded_row) - torch.tensor(starts)).repeat_interleave(lens)
    if len(groups) == 1 and torch.equal(groups[0].query_index, token) and torch.equal(output_index, token):
        groups[0].query_index = None
        return ExtendPlan(groups, None)
    for group in groups:
        group.query_index = group.query_index.to(device)
    return ExtendPlan(groups, output_index.to(device))
