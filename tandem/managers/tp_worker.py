"""`TpModelWorker`: one tensor-parallel rank's model worker.

It turns a `ScheduleBatch` (whose KV slots the scheduler has allocated) into next
token ids: ForwardBatch -> ModelRunner.forward -> sampler. The overlap scheduler will
wrap this same call in a forward thread/stream; keep it free of scheduler state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.managers.schedule_batch import ScheduleBatch
from tandem.model_executor.model_runner import ModelRunner
from tandem.server_args import ServerArgs


@dataclass
class GenerationBatchResult:
    next_token_ids: list[int]


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
        logits = self.model_runner.forward(fb)
        info = batch.sampling_info(self.model_runner.vocab_size, self.device)
        next_ids = self.model_runner.sample(logits, info)
        return GenerationBatchResult(next_token_ids=next_ids.tolist())
