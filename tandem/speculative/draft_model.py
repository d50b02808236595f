"""STANDALONE drafts: a small draft model (same tokenizer) proposes k tokens per request.

The draft model has its own ModelRunner and KV pool, sized like the target's, and shares
the target's ReqToTokenPool: its KV of token position p lives at the same slot as the
target's, in its own buffers, so the target's allocation, the prefix cache and
`release_rejected` own both (SGLang's draft workers share the rows the same way). The
draft's KV is filled lazily: each request records how many leading positions hold the
draft's KV (`SpecReqState.draft_kv_len`, valid for its row and retraction count); a
proposal first extends the draft over the positions it lacks up to the newest token
(prefill on its first step), then decodes k - 1 more. Drafts never change the output
(the target verifies each), only how many are accepted.

A sampled request's drafts are drawn from the draft's distribution at the request's
sampling params (`draft_probs`, for rejection sampling); a greedy one's are its argmax.
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.forward_batch import ForwardBatch, ForwardMode
from tandem.layers.sampler import SamplingBatchInfo, categorical, generator_uniforms, sampling_probs
from tandem.model_executor.model_runner import ModelRunner
from tandem.scheduler.schedule_batch import Req
from tandem.server_args import ServerArgs


class DraftModel:
    def __init__(self, server_args: ServerArgs, target_runner: ModelRunner):
        path = server_args.speculative_draft_model_path
        args = dataclasses.replace(
            server_args,
            model_path=path,
            tokenizer_path=path,
            load_format="dummy" if server_args.load_format == "dummy" else "auto",
            max_total_tokens=target_runner.max_total_num_tokens,
            max_running_requests=target_runner.max_running_requests,
            context_length=target_runner.context_len,
            speculative_algorithm=None,
            speculative_draft_model_path=None,
            enable_lora=False,  # adapters are the target's: the draft proposes from its base weights
            lora_paths=None,
        )
        self.runner = ModelRunner(args, req_to_token_pool=target_runner.req_to_token_pool)
        self.vocab_size = target_runner.vocab_size
        self.device = target_runner.device

    @torch.inference_mode()
    def propose(self, reqs: list[Req], counts: list[int]) -> tuple[list[list[int]], torch.Tensor]:
        """`counts[i]` drafts for reqs[i] (whose verify slots are in its row already), and
        their distributions [sum(1 + counts), vocab], rows aligned with the verify forward
        (each request's last row zero)."""
        drafts: list[list[int]] = [[] for _ in reqs]
        probs = torch.zeros(sum(counts) + len(counts), self.vocab_size, device=self.device)
        starts = [sum(counts[:i]) + i for i in range(len(counts))]
        live = [i for i, k in enumerate(counts) if k > 0]
        fb = self._catch_up([reqs[i] for i in live])
        for step in range(max(counts)):
            if step > 0:
                live = [i for i in live if counts[i] > step]
                fb = self._decode_step([reqs[i] for i in live], [drafts[i][-1] for i in live], step)
            logits = self.runner.forward(fb).next_token_logits
            params = [reqs[i].sampling_params for i in live]
            info = SamplingBatchInfo(
                params, [len(reqs[i].output_ids) + step for i in live], self.vocab_size, self.device
            )
            tokens, q = self._sample(logits, info)
            for n, i in enumerate(live):
                drafts[i].append(tokens[n])
                probs[starts[i] + step] = q[n]
        for req, k in zip(reqs, counts):
            if k > 0:  # positions 0 .. newest + k - 2 hold the draft's KV now
                req.spec.draft_kv_len = req.kv_len + k
        return drafts, probs

    def _catch_up(self, reqs: list[Req]) -> ForwardBatch:
        """An EXTEND batch over each request's positions that lack the draft's KV, up to
        its newest token (whose slot is the first of its verify slots)."""
        rows = self.runner.req_to_token_pool.req_to_token
        input_ids, positions, slots, prefix_lens, extend_lens = [], [], [], [], []
        for req in reqs:
            key = (req.req_pool_idx, req.retractions)
            if req.spec.draft_key != key:  # a new row: nothing of it is the draft's yet
                req.spec.draft_key, req.spec.draft_kv_len = key, 0
            start, end = min(req.spec.draft_kv_len, req.kv_len), req.seq_len
            input_ids += req.seq_ids[start:end]
            positions += range(start, end)
            slots.append(rows[req.req_pool_idx, start:end])
            prefix_lens.append(start)
            extend_lens.append(end - start)
        return self._batch(ForwardMode.EXTEND, reqs, input_ids, positions, torch.cat(slots), prefix_lens, extend_lens)

    def _decode_step(self, reqs: list[Req], tokens: list[int], step: int) -> ForwardBatch:
        """A DECODE batch feeding each request's previous draft, at position newest + step."""
        positions = [req.seq_len - 1 + step for req in reqs]
        rows = self.runner.req_to_token_pool.req_to_token
        slots = torch.stack([rows[req.req_pool_idx, p] for req, p in zip(reqs, positions)])
        return self._batch(ForwardMode.DECODE, reqs, tokens, positions, slots, positions, [1] * len(reqs))

    def _batch(self, mode, reqs, input_ids, positions, slots, prefix_lens, extend_lens) -> ForwardBatch:
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        extend = mode.is_extend()
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(reqs),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            out_cache_loc=slots,
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=self.device),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=extend_lens,
            input_logprob_starts=[-1] * len(reqs) if extend else None,
            top_logprobs_nums=[0] * len(reqs) if extend else None,
            token_ids_logprobs=[None] * len(reqs) if extend else None,
        )

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> tuple[list[int], torch.Tensor]:
        """Draft tokens (greedy rows: the argmax) and the distributions they were drawn from."""
        q = sampling_probs(logits, info)
        greedy = torch.tensor(info.is_greedy, device=logits.device)
        tokens = torch.where(
            greedy, torch.argmax(logits, dim=-1), categorical(q, generator_uniforms(q, self.runner.sampler.generator))
        )
        return tokens.tolist(), q
