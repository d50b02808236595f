"""The CUDA graph runner's bookkeeping on CPU: buckets, static buffers, padding rows and
the attention backend's capture/replay hooks, with each "graph" replayed eagerly (its
body run again) over the triton backend under Triton's interpreter. Decode through the
runner, at batch sizes that fill a bucket and that need padding, gives the tokens and
logits of eager decode. The graphs themselves run in tests/cuda."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the Triton backend is untested")

from runner_steps import greedy_steps, make_runner  # noqa: E402

from tandem.model_executor.cuda_graph_runner import CudaGraphRunner  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[1, 5, 9, 13, 2, 7], [1, 4], [1, 8, 8, 30, 31, 40, 41, 50, 60, 61, 62]]


class EagerGraph:
    def __init__(self, body):
        self.replay = body


class EagerGraphRunner(CudaGraphRunner):
    """Capture without CUDA: each bucket's graph body, replayed by calling it."""

    def capture(self) -> None:
        self.graphs = {bs: EagerGraph(self.graph_body(bs)) for bs in reversed(self.batch_sizes)}


def test_padded_replay_equals_eager_decode(tiny_llama_dir):
    kwargs = dict(device=DEVICE, dtype="float32", attention_backend="triton", disable_cuda_graph=True)
    eager, graphs = make_runner(tiny_llama_dir, **kwargs), make_runner(tiny_llama_dir, **kwargs)
    runner = EagerGraphRunner(
        lambda fb: graphs.model(fb, graphs.ctx), graphs.attn_backend, [1, 2, 4], graphs.vocab_size, DEVICE
    )
    graphs.cuda_graph_runner = runner
    replayed = []
    replay = runner.replay
    runner.replay = lambda fb: replayed.append(fb.batch_size) or replay(fb)
    for prompts in (PROMPTS[:1], PROMPTS):  # bucket 1 exactly; 3 requests padded to bucket 4
        ids_a, logits_a = greedy_steps(eager, prompts, 3)
        ids_b, logits_b = greedy_steps(graphs, prompts, 3)
        assert ids_a == ids_b
        for a, b in zip(logits_a, logits_b):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert replayed == [1] * 3 + [3] * 3  # every decode step went through the runner
    # The padding rows of bucket 4 hold row 0, one key, slot 0.
    assert runner.seq_lens[3].item() == 1 and runner.out_cache_loc[3].item() == 0
