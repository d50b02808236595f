"""`TpModelWorker`: one tensor-parallel rank's model worker.

It runs a `ModelWorkerBatch` (the scheduler's snapshot of a batch, whose KV slots the
scheduler has allocated): ModelRunner.forward, then sampling (a separate call, so a
caller can sample later or differently). It reads no scheduler state and returns device
tensors; `GenerationBatchResult.to_host` turns them into Python lists when the
scheduler processes the result. Sampled ids also go into the `FutureMap`, from which
the next forward reads the inputs that the scheduler could only name by placeholder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.layers.logits_processor import InputLogprobs, LogitsProcessorOutput
from tandem.model_executor.model_runner import ModelRunner
from tandem.scheduler.future_map import FutureMap
from tandem.scheduler.schedule_batch import ModelWorkerBatch
from tandem.server_args import ServerArgs
from tandem.speculative.verify import verify_drafts


@dataclass
class HostBatchResult:
    """A forward's result as Python values, one entry per request of the batch."""

    next_token_ids: list[int]
    # Filled only for requests that asked for logprobs (else None per request).
    next_token_logprobs: list[float | None]
    next_top_logprobs: list[list[tuple[float, int]] | None]
    # (logprob, token_id) of each id of the request's token_ids_logprob (None: none asked).
    next_token_ids_logprobs: list[list[tuple[float, int]] | None]
    input_logprobs: list[InputLogprobs | None]
    # Rows whose custom logit processor raised -> its error (those requests fail alone).
    failed: dict[int, str] = field(default_factory=dict)
    # Speculative verification: drafts accepted per request; the token lists above then
    # hold accept_lens[i] + 1 entries for request i, request after request. None: one each.
    accept_lens: list[int] | None = None

    def rows_of(self, i: int) -> range:
        """The entries of request i."""
        if self.accept_lens is None:
            return range(i, i + 1)
        start = sum(self.accept_lens[:i]) + i
        return range(start, start + self.accept_lens[i] + 1)


@dataclass
class GenerationBatchResult:
    """A forward's result as the worker made it: tensors on its device. Output logprobs
    cover only `logprob_rows`, the requests that asked for them."""

    next_token_ids: torch.Tensor  # [bs]
    input_logprobs: list[InputLogprobs | None]
    logprob_rows: list[int] = field(default_factory=list)
    token_logprobs: torch.Tensor | None = None  # [rows] logprob of the sampled id
    top_values: torch.Tensor | None = None  # [rows, k_max]
    top_ids: torch.Tensor | None = None
    token_ids_logprobs: list[torch.Tensor | None] = field(default_factory=list)  # per row
    # Recorded after the copies to the host were queued (CUDA); None: already on the host.
    copy_done: torch.cuda.Event | None = None
    # Rows whose custom logit processor raised -> its error.
    failed: dict[int, str] = field(default_factory=dict)
    # Speculative verification: drafts accepted per request, and the request of each
    # entry of next_token_ids (see HostBatchResult); None: one entry per request.
    accept_lens: list[int] | None = None
    owners: list[int] | None = None

    def copy_to_host(self) -> None:
        """Queue the device-to-host copies and record `copy_done` (no-op on CPU)."""
        if self.next_token_ids.device.type != "cuda":
            return

        def host(t):
            return None if t is None else t.to("cpu", non_blocking=True)

        self.next_token_ids, self.token_logprobs = host(self.next_token_ids), host(self.token_logprobs)
        self.top_values, self.top_ids = host(self.top_values), host(self.top_ids)
        self.token_ids_logprobs = [host(t) for t in self.token_ids_logprobs]
        self.copy_done = torch.cuda.Event()
        self.copy_done.record()

    def to_host(self, mwb: ModelWorkerBatch) -> HostBatchResult:
        """The lists the scheduler works with (waits for `copy_done` first)."""
        if self.copy_done is not None:
            self.copy_done.synchronize()
        n = int(self.next_token_ids.numel())
        out = HostBatchResult(
            self.next_token_ids.tolist(),
            [None] * n,
            [None] * n,
            [None] * n,
            self.input_logprobs,
            self.failed,
            self.accept_lens,
        )
        if not self.logprob_rows:
            return out
        chosen = self.token_logprobs.tolist()
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        for j, i in enumerate(self.logprob_rows):
            owner = i if self.owners is None else self.owners[i]
            k = mwb.top_logprobs_nums[owner]
            out.next_token_logprobs[i] = chosen[j]
            out.next_top_logprobs[i] = list(zip(values[j][:k], ids[j][:k]))
            wanted = mwb.token_ids_logprob[owner]
            if wanted is not None:
                out.next_token_ids_logprobs[i] = list(zip(self.token_ids_logprobs[j].tolist(), wanted))
        return out


class TpModelWorker:
    def __init__(self, server_args: ServerArgs, tp_rank: int = 0, tp_size: int = 1):
        self.model_runner = ModelRunner(server_args, tp_rank=tp_rank, tp_size=tp_size)
        self.device = self.model_runner.device
        self.future_map = FutureMap(self.model_runner.req_to_token_pool.size, self.device)

    @property
    def req_to_token_pool(self):
        return self.model_runner.req_to_token_pool

    @property
    def token_to_kv_pool(self):
        return self.model_runner.token_to_kv_pool

    @torch.inference_mode()
    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        """Forward, sample, gather the wanted logprobs; the result stays on the device."""
        out = self.forward(mwb)
        if mwb.draft_ids is not None:
            return self._verify(mwb, out)
        next_ids = self.sample(out.next_token_logits, mwb)
        return self._result(mwb, out.next_token_logits, out.input_logprobs, next_ids)

    def _verify(self, mwb: ModelWorkerBatch, out: LogitsProcessorOutput) -> GenerationBatchResult:
        """A speculative verify forward's result: every request's accepted tokens
        (tandem/speculative/verify.py), with their logprobs where asked."""
        logits = out.next_token_logits
        verified = verify_drafts(logits, mwb.sampling_info, self.model_runner.sampler, mwb.draft_ids, mwb.draft_probs)
        owners = [i for i, n in enumerate(verified.accept_lens) for _ in range(n + 1)]
        result = self._result(mwb, logits[verified.rows], out.input_logprobs, verified.token_ids, owners)
        result.accept_lens = verified.accept_lens
        return result

    @torch.inference_mode()
    def forward(self, mwb: ModelWorkerBatch) -> LogitsProcessorOutput:
        fb = mwb.forward_batch
        if fb.placeholders:
            fb.input_ids = self.future_map.resolve(fb.input_ids)
        return self.model_runner.forward(fb)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, mwb: ModelWorkerBatch) -> torch.Tensor:
        """Next ids [bs] from `logits`; they are also stored for the next forward's inputs."""
        info = mwb.sampling_info
        if mwb.vocab_mask is not None:  # a masked copy: logprobs stay those of `logits`
            logits = mwb.vocab_mask.apply(logits)
        if info.penalties is not None:
            info = info.with_penalties(info.penalties.resolved(self.future_map.resolve))
        if info.custom is not None:  # the processors read the output ids so far
            info.custom.resolve_output_ids(self.future_map.resolve, self.device)
        next_ids = self.model_runner.sample(logits, info)
        self.future_map.store(mwb.forward_batch.req_pool_indices, next_ids)
        return next_ids

    @staticmethod
    def _result(
        mwb: ModelWorkerBatch,
        logits: torch.Tensor,
        input_logprobs: list,
        next_ids: torch.Tensor,
        owners: list[int] | None = None,
    ) -> GenerationBatchResult:
        """`logits` [n, vocab]: the row each of the n `next_ids` was sampled from; `owners`:
        the request of each (None: row i is request i)."""
        result = GenerationBatchResult(next_token_ids=next_ids, input_logprobs=input_logprobs, owners=owners)
        if mwb.sampling_info.custom is not None:
            result.failed = mwb.sampling_info.custom.failed
        owner = owners or list(range(len(mwb.return_logprob)))
        rows = [j for j, i in enumerate(owner) if mwb.return_logprob[i]]
        if rows:
            logprobs = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)], dim=-1)
            result.logprob_rows = rows
            result.token_logprobs = logprobs.gather(1, next_ids[rows].unsqueeze(1)).squeeze(1)
            k_max = max(mwb.top_logprobs_nums[owner[j]] for j in rows)
            result.top_values, result.top_ids = logprobs.topk(k_max, dim=-1)
            wanted = [mwb.token_ids_logprob[owner[j]] for j in rows]
            result.token_ids_logprobs = [
                None if ids is None else logprobs[r, torch.tensor(ids, dtype=torch.int64, device=logits.device)]
                for r, ids in enumerate(wanted)
            ]
        result.copy_to_host()
        return result
