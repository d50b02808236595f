"""Penalties and min_new_tokens (`tandem.sampling.penalties`) against references we did
not write (transformers' repetition-penalty processor) or that are written out per
token here (OpenAI's frequency/presence formula)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from tandem.layers.sampler import Sampler, SamplingBatchInfo
from tandem.sampling.penalties import PenaltyBatch, PenaltyInput
from tandem.sampling.sampling_params import SamplingParams

VOCAB = 50


def _input(prompt, output, banned=(), **params) -> PenaltyInput:
    return PenaltyInput(SamplingParams(**params), list(prompt), list(output), list(banned))


def test_no_penalties_builds_nothing():
    assert PenaltyBatch.build([_input([1, 2], [3]), _input([4], [])], "cpu") is None


def test_repetition_penalty_equals_transformers():
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB) * 3
    seqs = [[1, 5, 5, 9, 30], [2, 7, 49, 0]]
    batch = PenaltyBatch.build(
        [
            _input(seqs[0][:3], seqs[0][3:], repetition_penalty=1.3),
            _input(seqs[1][:1], seqs[1][1:], repetition_penalty=0.7),
        ],
        "cpu",
    )
    out = batch.apply(logits)
    for row, (penalty, seq) in enumerate(zip([1.3, 0.7], seqs)):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([seq]), logits[row : row + 1].clone())
        torch.testing.assert_close(out[row : row + 1], expected)


def test_frequency_and_presence_follow_openai_formula():
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    reqs = [
        _input([3, 3, 4], [3, 8, 8, 8], frequency_penalty=0.5, presence_penalty=-0.25),
        _input([1], [], presence_penalty=1.0),  # nothing generated yet: unchanged
        _input([6], [6, 6], frequency_penalty=2.0),
    ]
    out = PenaltyBatch.build(reqs, "cpu").apply(logits)
    expected = logits.clone()
    for row, req in enumerate(reqs):
        for token in set(req.output_ids):  # the prompt does not count
            count = req.output_ids.count(token)
            expected[row, token] -= count * req.params.frequency_penalty + req.params.presence_penalty
    torch.testing.assert_close(out, expected)


def test_min_new_tokens_bans_until_reached_and_leaves_input_alone():
    logits = torch.zeros(2, VOCAB)
    before = logits.clone()
    reqs = [
        _input([1], [4, 4], banned=[2, 7], min_new_tokens=3, max_new_tokens=5),
        _input([1], [4, 4, 4], banned=[2, 7], min_new_tokens=3, max_new_tokens=5),
    ]
    out = PenaltyBatch.build(reqs, "cpu").apply(logits)
    assert torch.isinf(out[0, [2, 7]]).all() and torch.isfinite(out[0, :2]).all()
    assert torch.isfinite(out[1]).all()  # reached: nothing banned
    assert torch.equal(logits, before)


def test_sampler_greedy_follows_penalized_logits():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    penalties = PenaltyBatch.build([PenaltyInput(params, [0], [1], [])], "cpu")
    info = SamplingBatchInfo([params], [1], 4, "cpu", penalties)
    assert Sampler(0, "cpu")(logits, info).tolist() == [2]
    assert Sampler(0, "cpu")(logits, SamplingBatchInfo([params], [1], 4, "cpu")).tolist() == [1]


@pytest.mark.parametrize(
    "params,field",
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": "x"}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
    ],
)
def test_out_of_range_values_name_the_field(params, field):
    with pytest.raises(ValueError, match=f"sampling_params.{field}"):
        SamplingParams.from_dict(params)
