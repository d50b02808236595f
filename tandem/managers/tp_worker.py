"""`TpModelWorker`: one tensor-parallel rank's model worker.

It turns a `ScheduleBatch` (whose KV slots the scheduler has allocated) into next
token ids: ForwardBatch -> ModelRunner.forward -> sampler. The overlap scheduler will
wrap this same call in a forward thread/stream; keep it free of scheduler state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.layers.logits_processor import InputLogprobs, token_ids_logprobs, top_logprobs
from tandem.managers.schedule_batch import ScheduleBatch
from tandem.model_executor.model_runner import ModelRunner
from tandem.server_args import ServerArgs


@dataclass
class GenerationBatchResult:
    next_token_ids: list[int]
    # Filled only for requests that asked for logprobs (else None per request).
    next_token_logprobs: list[float | None] = field(default_factory=list)
    next_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    # (logprob, token_id) of each id of the request's token_ids_logprob (None: none asked).
    next_token_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_logprobs: list[InputLogprobs | None] = field(default_factory=list)


class TpModelWorker:
    def __init__(self, server_args: ServerArgs, tp_rank: int = 0, tp_size: int = 1):
        self.model_runner = ModelRunner(server_args, tp_rank=tp_rank, tp_size=tp_size)
        self.device = self.model_runner.device

    @property
    def req_to_token_pool(self):
        return self.model_runner.req_to_token_pool

    @property
    def token_to_kv_pool(self):
        return self.model_runner.token_to_kv_pool

    @torch.inference_mode()
    def forward_batch_generation(self, batch: ScheduleBatch) -> GenerationBatchResult:
        fb = batch.to_forward_batch(self.device)
        out = self.model_runner.forward(fb)
        info = batch.sampling_info(self.model_runner.vocab_size, self.device)
        next_ids = self.model_runner.sample(out.next_token_logits, info)
        result = GenerationBatchResult(next_token_ids=next_ids.tolist(), input_logprobs=out.input_logprobs)
        self._output_logprobs(batch, out.next_token_logits, next_ids, result)
        return result

    @staticmethod
    def _output_logprobs(batch: ScheduleBatch, logits: torch.Tensor, next_ids: torch.Tensor,
                         result: GenerationBatchResult) -> None:
        wanted = [i for i, r in enumerate(batch.reqs) if r.return_logprob]
        result.next_token_logprobs = [None] * batch.batch_size()
        result.next_top_logprobs = [None] * batch.batch_size()
        result.next_token_ids_logprobs = [None] * batch.batch_size()
        if not wanted:
            return
        rows = torch.tensor(wanted, device=logits.device)
        logprobs = torch.log_softmax(logits[rows], dim=-1)
        chosen = logprobs.gather(1, next_ids[rows].unsqueeze(1)).squeeze(1).tolist()
        k_max = max(batch.reqs[i].top_logprobs_num for i in wanted)
        tops = top_logprobs(logprobs, k_max)
        for j, i in enumerate(wanted):
            result.next_token_logprobs[i] = chosen[j]
            result.next_top_logprobs[i] = tops[j][: batch.reqs[i].top_logprobs_num]
            if batch.reqs[i].token_ids_logprob is not None:
                result.next_token_ids_logprobs[i] = token_ids_logprobs(
                    logprobs[j : j + 1], batch.reqs[i].token_ids_logprob)[0]
