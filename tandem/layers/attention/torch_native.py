"""Attention in plain PyTorch over the paged KV pool: runs on any device.

Requests are ragged; the model never computes padded tokens:
- EXTEND and DECODE on CPU: Tandem's C++ kernels (tandem/kernels/csrc/extend_attention_cpu.cpp,
  decode_attention_cpu.cpp) read each request's keys and values in place through the
  request's row of the ReqToTokenPool, in float32, requests in parallel, window and soft-cap
  included (docs/architecture.md, "Attention backends"). They are built for the machine on
  first use (tandem/kernels/cpu.py); where they cannot be (no C++ compiler) or the shapes do
  not suit them (head_dim not a multiple of 16), the PyTorch paths below run instead.
- EXTEND elsewhere: requests of similar sizes are attended together by one SDPA call over a
  padded block (extend_plan.py): causal without a mask (grouped-query heads through SDPA's
  `enable_gqa`) when they have no cached prefix, else a prefix-offset causal mask with the
  query heads that share a KV head stacked on SDPA's query axis.
- DECODE elsewhere: one query per request, a handful of kernels per layer whatever the
  batch size. When lengths are similar, each request's keys are gathered into a [bs, max_len] block
  with a length mask and one SDPA call runs (fastest on CPU). When they are very uneven,
  the keys of all requests go on one flat axis tagged with their request and the softmax
  is taken per segment (scatter/index_add), so no key is read twice or padded.
  Gathers use index_select: on CPU it is several times faster than advanced indexing.
  With `--enable-torch-compile` (and no C++ kernel) the blocked path instead runs `paged_decode` compiled by
  Inductor, which reads K and V through the slot table in place (no gathered copy); it is
  compiled when the backend is built (server start), not on the first request.
- SLIDING WINDOW and LOGIT SOFT-CAP (per layer: `sliding_window`, `logit_cap`): the C++
  kernels take both; elsewhere extend with a window only runs SDPA with the windowed causal
  mask (`ExtendGroup.window_mask`); a soft-capped layer's extend, and the PyTorch decode
  of either, compute the scores explicitly in float32 (`masked_attention`: SDPA cannot
  soft-cap). The keys before a window stay in the pool, masked.
- MIXED (`--enable-mixed-chunk`: an EXTEND batch whose last rows are running requests
  decoding one token each, `ForwardBatch.num_prefill`): the prefill rows take the extend
  path and the decode rows the batched decode, in the same forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.forward_batch import ForwardBatch
from tandem.kernels import cpu as cpu_kernels
from tandem.layers.attention.base import AttentionBackend
from tandem.layers.attention.extend_plan import ExtendPlan, plan_extend, slot_table
from tandem.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool


def paged_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    table: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """One-token attention per request over its KV slots, written for Inductor to fuse.

    q [bs, kv_heads, group, D]; k/v_buffer [slots, kv_heads, D], one layer of the pool;
    table/valid [bs, max_len] (`_kv_table`); scale a 0-dim float32 tensor (a Python float
    would be compiled in as a constant). Returns [bs, kv_heads * group * D] in q's dtype,
    computed in float32. Eager, this gathers; compiled, the indexing becomes loads inside
    one loop, so the pool is read in place."""
    bs, kv_heads, group, head_dim = q.shape
    k = k_buffer[table].float()  # [bs, L, kv_heads, D]
    v = v_buffer[table].float()
    scores = (q.float().unsqueeze(1) * k.unsqueeze(3)).sum(-1) * scale  # [bs, L, kv_heads, group]
    scores = scores.masked_fill(~valid.view(bs, -1, 1, 1), float("-inf"))
    out = (scores.softmax(dim=1).unsqueeze(-1) * v.unsqueeze(3)).sum(1)  # [bs, kv_heads, group, D]
    return out.to(q.dtype).reshape(bs, kv_heads * group * head_dim)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float, logit_cap: float
) -> torch.Tensor:
    """Attention with explicit scores, in float32: q [b, H, n, D], k/v [b, KVH, L, D] (query
    head h reads KV head h // (H / KVH)), mask broadcastable to [b, H, n, L] (True: seen).
    Scores scaled, soft-capped when `logit_cap` > 0 (`logit_cap * tanh(s / logit_cap)`),
    masked, softmaxed. Returns [b, H, n, D] in q's dtype."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float(), v.float()
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scaling
    if logit_cap > 0:
        scores = torch.tanh(scores / logit_cap).mul_(logit_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v).to(q.dtype)


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: TokenToKVPool,
        enable_torch_compile: bool = False,
        num_heads: int = 1,
    ):
        """`enable_torch_compile`: blocked decode runs `paged_decode` through `torch.compile`,
        compiled here (before the first request) for this rank's `num_heads` query heads."""
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = token_to_kv_pool
        self.forward_metadata: tuple[torch.Tensor, torch.Tensor] | None = None
        # A mixed batch's (prefill part, decode part), set by `init_forward_metadata`.
        self.mixed_parts: tuple[ForwardBatch, ForwardBatch] | None = None
        # An EXTEND forward's (or a mixed batch's prefill part's) SDPA groups.
        self.extend_plan: ExtendPlan | None = None
        ops = self._cpu_attention_ops(token_to_kv_pool, num_heads)
        self.decode_kernel = None if ops is None else ops.decode_attention
        self.extend_kernel = None if ops is None else ops.extend_attention
        # An EXTEND forward's (or a mixed batch's prefill part's) prefix and extend lengths
        # as CPU tensors, for `extend_kernel` (which then runs instead of `extend_plan`).
        self.extend_lens: tuple[torch.Tensor, torch.Tensor] | None = None
        self.compiled_decode = (
            torch.compile(paged_decode) if enable_torch_compile and self.decode_kernel is None else None
        )
        if self.compiled_decode is not None:
            self._compile_decode(num_heads)

    @staticmethod
    def _cpu_attention_ops(kv_pool: TokenToKVPool, num_heads: int):
        """Tandem's C++ kernels (decode and extend attention) when the pool is on CPU and its
        shapes suit them, else None."""
        _, kv_heads, head_dim = kv_pool.k_buffer[0].shape
        if kv_pool.k_buffer[0].device.type != "cpu" or head_dim % 16 or head_dim > 256 or num_heads > 64 * kv_heads:
            return None
        return cpu_kernels.load()

    @torch.inference_mode()
    def _compile_decode(self, num_heads: int) -> None:
        """Compile `paged_decode` for every shape it will meet, under inference mode as the
        model's forward runs (a graph assumes its grad mode). The batch and key-length axes
        are marked dynamic, other sizes are the model's. A dynamic size still specializes
        on 1, so batch 1 and batch >= 2 are one graph each (decode lengths are >= 2); the
        sizes 2 and 3 differ so that no equality between the axes is assumed. The inputs
        read only slot 0, the zeroed padding slot."""
        k_buffer = self.kv_pool.k_buffer[0]
        _, kv_heads, head_dim = k_buffer.shape
        for bs in (1, 2):
            q = torch.zeros(bs, kv_heads, num_heads // kv_heads, head_dim, dtype=k_buffer.dtype, device=k_buffer.device)
            table = torch.zeros(bs, 3, dtype=self.req_to_token.dtype, device=k_buffer.device)
            valid = table == 0
            for tensor in (table, valid):
                torch._dynamo.mark_dynamic(tensor, 1)
            if bs > 1:
                for tensor in (q, table, valid):
                    torch._dynamo.mark_dynamic(tensor, 0)
            self.compiled_decode(q, k_buffer, self.kv_pool.v_buffer[0], table, valid, torch.tensor(head_dim**-0.5))

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Decode: each request's KV table, shared by every layer (see `_kv_table`). A mixed
        batch: its two parts, and its decode part's KV table."""
        self.mixed_parts = forward_batch.mixed_parts() if forward_batch.is_mixed() else None
        decode = self.mixed_parts[1] if self.mixed_parts else forward_batch
        self.forward_metadata = (
            self._kv_table(decode) if decode.forward_mode.is_decode() and self.decode_kernel is None else None
        )
        prefill = self.mixed_parts[0] if self.mixed_parts else forward_batch
        extend = prefill.forward_mode.is_extend()
        self.extend_lens = self.extend_plan = None
        if extend and self.extend_kernel is not None:
            self.extend_lens = (torch.tensor(prefill.prefix_lens_cpu), torch.tensor(prefill.extend_lens_cpu))
        elif extend:
            self.extend_plan = plan_extend(prefill, self.req_to_token)

    def forward(
        self, q, layer_id, forward_batch, scaling, num_heads, num_kv_heads, head_dim, sliding_window=0, logit_cap=0.0
    ):
        """As `AttentionBackend.forward`, but a mixed batch is split (`_forward_mixed`)."""
        args = (q, layer_id, forward_batch, scaling, num_heads, num_kv_heads, head_dim)
        if forward_batch.is_mixed():
            return self._forward_mixed(*args, sliding_window=sliding_window, logit_cap=logit_cap)
        return super().forward(*args, sliding_window=sliding_window, logit_cap=logit_cap)

    def _forward_mixed(self, q, layer_id, _fb, scaling, num_heads, num_kv_heads, head_dim, **window_cap):
        """A mixed batch in one call per layer: the prefill rows' tokens (first) take the
        extend path, the decode rows' tokens (after them, one each) the batched decode,
        as a decode batch of their own would."""
        prefill, decode = self.mixed_parts
        split = prefill.num_tokens
        return torch.cat(
            [
                self.forward_extend(
                    q[:split], layer_id, prefill, scaling, num_heads, num_kv_heads, head_dim, **window_cap
                ),
                self.forward_decode(
                    q[split:], layer_id, decode, scaling, num_heads, num_kv_heads, head_dim, **window_cap
                ),
            ]
        )

    def cpu_decode_tables(self, fb: ForwardBatch):
        if self.decode_kernel is None or not fb.forward_mode.is_decode() or fb.is_mixed():
            return None
        return self.req_to_token, fb.req_pool_indices, fb.seq_lens

    def forward_decode(
        self, q, layer_id, fb: ForwardBatch, scaling, num_heads, num_kv_heads, head_dim, sliding_window=0, logit_cap=0.0
    ):
        if self.decode_kernel is not None:
            return self.decode_kernel(
                q.view(fb.batch_size, num_heads, head_dim),
                self.kv_pool.k_buffer[layer_id],
                self.kv_pool.v_buffer[layer_id],
                self.req_to_token,
                fb.req_pool_indices,
                fb.seq_lens,
                scaling,
                sliding_window,
                logit_cap,
            )
        if sliding_window > 0 or logit_cap > 0:
            return self._decode_masked(
                q, layer_id, fb, scaling, num_heads, num_kv_heads, head_dim, sliding_window, logit_cap
            )
        if self._padded_waste_ok(fb):
            return self._decode_blocked(q, layer_id, fb, scaling, num_heads, num_kv_heads, head_dim)
        return self._decode_segmented(q, layer_id, fb, scaling, num_heads, num_kv_heads, head_dim)

    @staticmethod
    def _padded_waste_ok(fb: ForwardBatch) -> bool:
        """Blocked decode reads max_len keys per request; worth it unless that more than
        doubles the keys read (very uneven lengths), where the segmented path wins."""
        return fb.batch_size * max(fb.seq_lens_cpu) <= 2 * sum(fb.seq_lens_cpu)

    def _decode_blocked(self, q, layer_id, fb: ForwardBatch, scaling, num_heads, num_kv_heads, head_dim):
        """Keys gathered as a [bs, max_len] block with a length mask, one SDPA call.

        Only the key axis of attention is blocked; the model never computes padded tokens.
        The query heads sharing a KV head are SDPA's query axis ([bs, kv_heads, group, D])
        rather than `enable_gqa` over one-token queries: each KV head is read once, and
        PyTorch's CPU flash kernel in bfloat16 runs 5-10x faster than on one-token queries
        (docs/perf-log/cpu-decode.md, "Where a decode step goes")."""
        bs = fb.batch_size
        table, valid = self.forward_metadata
        qg = q.view(bs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if self.compiled_decode is not None:
            return self.compiled_decode(
                qg,
                self.kv_pool.k_buffer[layer_id],
                self.kv_pool.v_buffer[layer_id],
                table,
                valid,
                torch.tensor(scaling),
            )
        max_len = table.shape[1]
        flat = table.reshape(-1)
        k = torch.index_select(self.kv_pool.k_buffer[layer_id], 0, flat).to(q.dtype)  # a narrower pool widened
        v = torch.index_select(self.kv_pool.v_buffer[layer_id], 0, flat).to(q.dtype)
        k = k.view(bs, max_len, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(bs, max_len, num_kv_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=valid.view(bs, 1, 1, max_len), scale=scaling)
        return out.reshape(bs, num_heads * head_dim)

    def _decode_masked(self, q, layer_id, fb: ForwardBatch, scaling, num_heads, num_kv_heads, head_dim, window, cap):
        """Blocked decode with explicit scores (`masked_attention`): the request's keys past
        the length mask, and before its window, are masked."""
        bs = fb.batch_size
        table, valid = self.forward_metadata
        max_len = table.shape[1]
        if window > 0:
            kpos = torch.arange(max_len, device=valid.device).unsqueeze(0)
            valid = valid & (kpos >= fb.seq_lens.unsqueeze(1) - window)
        flat = table.reshape(-1)
        k = torch.index_select(self.kv_pool.k_buffer[layer_id], 0, flat).to(q.dtype)  # a narrower pool widened
        v = torch.index_select(self.kv_pool.v_buffer[layer_id], 0, flat).to(q.dtype)
        k = k.view(bs, max_len, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(bs, max_len, num_kv_heads, head_dim).transpose(1, 2)
        out = masked_attention(q.view(bs, num_heads, 1, head_dim), k, v, valid.view(bs, 1, 1, max_len), scaling, cap)
        return out.reshape(bs, num_heads * head_dim)

    def _kv_table(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[bs, max_len] KV slots of each request (slot 0 past its end) and the validity mask.

        Computed once per forward by `init_forward_metadata`."""
        return slot_table(self.req_to_token, fb.req_pool_indices, fb.seq_lens, max(fb.seq_lens_cpu))

    def _decode_segmented(self, q, layer_id, fb: ForwardBatch, scaling, num_heads, num_kv_heads, head_dim):
        """Keys of all requests on one flat axis, softmax per request segment (no padding)."""
        bs, group = fb.batch_size, num_heads // num_kv_heads
        table, valid = self.forward_metadata
        slots = table[valid]
        seg = torch.arange(bs, device=q.device).repeat_interleave(fb.seq_lens)
        k = torch.index_select(self.kv_pool.k_buffer[layer_id], 0, slots).float()  # [T, KVH, D]
        v = torch.index_select(self.kv_pool.v_buffer[layer_id], 0, slots).float()
        qg = q.view(bs, num_kv_heads, group, head_dim).float()
        scores = torch.einsum("tkd,tkgd->tkg", k, torch.index_select(qg, 0, seg)) * scaling  # [T, KVH, G]
        shape = (bs, num_kv_heads, group)
        peak = torch.full(shape, float("-inf"), device=q.device).scatter_reduce_(
            0, seg.view(-1, 1, 1).expand_as(scores), scores, "amax"
        )
        weights = torch.exp(scores - torch.index_select(peak, 0, seg))
        denom = torch.zeros(shape, device=q.device).index_add_(0, seg, weights)
        out = torch.zeros((*shape, head_dim), device=q.device).index_add_(
            0, seg, weights.unsqueeze(-1) * v.unsqueeze(2)
        )
        return (out / denom.unsqueeze(-1)).to(q.dtype).reshape(bs, num_heads * head_dim)

    def forward_extend(
        self, q, layer_id, forward_batch, scaling, num_heads, num_kv_heads, head_dim, sliding_window=0, logit_cap=0.0
    ):
        """One SDPA call per group of `extend_plan` (built by `init_forward_metadata`), keys
        gathered with `index_select`, queries too unless the group is the batch as laid out.
        A causal group (no prefix) uses `is_causal` and `enable_gqa`; a masked group stacks
        the query heads sharing a KV head on SDPA's query axis ([size, kv_heads, group * n,
        D]), as blocked decode does: measured on 2 EPYC cores (one thread), PyTorch's CPU
        kernel in bfloat16 is then up to 5x faster for few queries over a long prefix,
        while `is_causal` (which skips the blocks above the diagonal) wins on long prompts.
        A windowed layer's group runs SDPA with its windowed mask, a soft-capped layer's
        `masked_attention` (float32 scores). On CPU Tandem's C++ kernel (`extend_kernel`) runs
        instead: each request's queries against its keys in place, in float32, window and
        soft-cap included (tandem/kernels/csrc/extend_attention_cpu.cpp)."""
        k_cache = self.kv_pool.k_buffer[layer_id]
        v_cache = self.kv_pool.v_buffer[layer_id]
        if self.extend_kernel is not None:
            prefix_lens, extend_lens = self.extend_lens
            return self.extend_kernel(
                q.view(-1, num_heads, head_dim),
                k_cache,
                v_cache,
                self.req_to_token,
                forward_batch.req_pool_indices,
                prefix_lens,
                extend_lens,
                scaling,
                sliding_window,
                logit_cap,
            )
        group_heads = num_heads // num_kv_heads
        plan = self.extend_plan
        outs = []
        for group in plan.groups:
            size, n, kv_len = group.size, group.num_queries, group.num_keys
            k = torch.index_select(k_cache, 0, group.slots).to(q.dtype)  # a narrower pool widened
            v = torch.index_select(v_cache, 0, group.slots).to(q.dtype)
            k = k.view(size, kv_len, num_kv_heads, head_dim).transpose(1, 2)
            v = v.view(size, kv_len, num_kv_heads, head_dim).transpose(1, 2)
            qg = q if group.query_index is None else torch.index_select(q, 0, group.query_index)
            qg = qg.reshape(size, n, num_heads, head_dim)
            if logit_cap > 0:
                o = masked_attention(
                    qg.transpose(1, 2), k, v, group.window_mask(sliding_window), scaling, logit_cap
                ).transpose(1, 2)
            elif sliding_window > 0:
                o = F.scaled_dot_product_attention(
                    qg.transpose(1, 2),
                    k,
                    v,
                    attn_mask=group.window_mask(sliding_window),
                    scale=scaling,
                    enable_gqa=group_heads > 1,
                ).transpose(1, 2)
            elif group.mask is None:
                o = F.scaled_dot_product_attention(
                    qg.transpose(1, 2), k, v, is_causal=True, scale=scaling, enable_gqa=group_heads > 1
                ).transpose(1, 2)
            else:
                qg = qg.view(size, n, num_kv_heads, group_heads, head_dim).permute(0, 2, 3, 1, 4)
                o = F.scaled_dot_product_attention(
                    qg.reshape(size, num_kv_heads, group_heads * n, head_dim),
                    k,
                    v,
                    attn_mask=group.stacked_mask(group_heads),
                    scale=scaling,
                )
                o = o.view(size, num_kv_heads, group_heads, n, head_dim).permute(0, 3, 1, 2, 4)
            outs.append(o.reshape(size * n, num_heads * head_dim))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if plan.output_index is None else torch.index_select(out, 0, plan.output_index)
