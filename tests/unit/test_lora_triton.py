"""The Triton LoRA kernels (tandem/lora/triton_ops.py, the CUDA path of `LoraBatch`) under
Triton's interpreter on CPU: the delta they add equals the PyTorch path's for segments of
uneven lengths (one longer than a block), base-model tokens left alone, fused parts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton LoRA kernels are untested")

from tandem.lora.batch import LoraBatch  # noqa: E402
from tandem.lora.pool import LoraLayerSlots  # noqa: E402


class _Layer:
    """What `add_delta` reads of a linear layer: its slots."""

    def __init__(self, slots):
        self.lora_slots = slots


def test_triton_delta_equals_torch():
    from tandem.lora.triton_ops import add_lora_delta

    torch.manual_seed(0)
    num_slots, parts, rank, in_features, out_features = 3, 3, 8, 48, 80
    width = parts * rank
    slots = LoraLayerSlots(
        torch.randn(num_slots, width, in_features),
        torch.randn(num_slots, width, out_features),
        rank,
        [0, 40, 60],
        [40, 20, 20],
        [0, 0, 0],
        0,
    )
    req_slots, extend_lens = [2, -1, 0, 2, 1], [30, 3, 1, 2, 5]  # slot 2's segment: 32 tokens (two blocks)
    batch = LoraBatch.build(req_slots, extend_lens, num_slots, torch.float32, "cpu")
    assert batch.token_slots is None  # the PyTorch path compared with is the segmented one
    x = torch.randn(sum(extend_lens), in_features)
    base = torch.randn(sum(extend_lens), out_features)
    want = batch.add_delta(_Layer(slots), x, base.clone())
    got = add_lora_delta(x, base.clone(), slots.a, slots.b, batch.slots, batch.token_index, batch.counts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[30:33], base[30:33], rtol=0, atol=0)  # the base request's rows
    assert not torch.allclose(want, base)
