"""`LoraBatch`: which adapter slot each token of a forward uses, laid out for segmented
matmuls, and the delta every target layer adds (`LinearBase.forward(x, lora)`).

Built once per forward from the requests' slots (-1: no adapter): the tokens of each
slot in use form one segment, padded to the longest, so a layer's delta is two batched
matmuls over [segments, longest, ...] whatever the mix of requests (the idea of SGLang's
and punica's segmented kernels; no loop over requests or adapters per layer). Tokens of
no adapter are in no segment and cost nothing; padding rows are masked to zero. A batch
whose tokens all use one adapter takes two plain matmuls; one of few tokens (decode,
`DENSE_MAX_TOKENS`) multiplies by every slot's weights at once (views of the pool, no
gather or scatter) and masks each token's products to its own slot's. On CUDA
the same segments run as Triton kernels that read the tokens in place (triton_ops.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.linear import LinearBase

# Batches of at most this many tokens (and several adapters) multiply by every slot (on CPU).
DENSE_MAX_TOKENS = 32


@dataclass
class LoraBatch:
    slots: torch.Tensor  # [n] the slot of each segment
    token_index: torch.Tensor  # [n, longest] the tokens of each segment (padding: token 0)
    mask: torch.Tensor  # [n, longest, 1] 1 for a real token, 0 for padding (model dtype)
    counts: torch.Tensor  # [n] the tokens of each segment (int32)
    # The slot when every token of the batch uses that one adapter (two plain matmuls on CPU).
    whole_slot: int | None = None
    # [tokens, slots, 1] 1 at each token's slot, when the batch is small enough for every slot at once.
    token_slots: torch.Tensor | None = None

    @classmethod
    def build(cls, req_slots: list[int], extend_lens: list[int], num_slots: int, dtype, device) -> LoraBatch | None:
        """The layout for requests whose slots (of `num_slots`) are `req_slots` (-1: none),
        computing `extend_lens[i]` tokens each; None when no request uses an adapter."""
        if all(s < 0 for s in req_slots):
            return None
        per_token = torch.repeat_interleave(torch.tensor(req_slots), torch.tensor(extend_lens))
        used = sorted({s for s in req_slots if s >= 0})
        groups = [torch.nonzero(per_token == s).flatten() for s in used]
        longest = max(g.numel() for g in groups)
        index = torch.zeros(len(used), longest, dtype=torch.int64)
        mask = torch.zeros(len(used), longest, 1, dtype=dtype)
        for i, g in enumerate(groups):  # one per adapter in use, at batch-building time
            index[i, : g.numel()] = g
            mask[i, : g.numel()] = 1
        counts = torch.tensor([g.numel() for g in groups], dtype=torch.int32, device=device)
        whole = used[0] if len(used) == 1 and longest == per_token.numel() else None
        token_slots = None
        if whole is None and per_token.numel() <= DENSE_MAX_TOKENS:
            token_slots = (per_token[:, None] == torch.arange(num_slots)[None, :]).to(dtype)[:, :, None].to(device)
        return cls(torch.tensor(used, device=device), index.to(device), mask.to(device), counts, whole, token_slots)

    def add_delta(self, layer: LinearBase, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base layer's output for `x`) plus each token's adapter delta, when
        `layer` is a LoRA target (in place)."""
        w = layer.lora_slots
        if w is None:
            return out
        if x.is_cuda:  # imported here: on CPU Triton is never loaded
            from tandem.lora.triton_ops import add_lora_delta

            return add_lora_delta(x, out, w.a, w.b, self.slots, self.token_index, self.counts)
        if self.whole_slot is not None:
            return out.add_((x @ w.a[self.whole_slot].t()) @ w.b[self.whole_slot])
        if self.token_slots is not None:  # every slot at once, each token masked to its own
            slots, width = w.a.shape[0], w.a.shape[1]
            h = (x @ w.a.view(slots * width, -1).t()).view(-1, slots, width) * self.token_slots
            return out.add_(h.view(-1, slots * width) @ w.b.view(slots * width, -1))
        xs = x[self.token_index]  # [n, longest, in]
        h = torch.bmm(xs, w.a[self.slots].transpose(1, 2)) * self.mask  # [n, longest, P*R]
        delta = torch.bmm(h, w.b[self.slots])  # [n, longest, out]
        return out.index_add_(0, self.token_index.flatten(), delta.reshape(-1, out.shape[-1]))
