"""Sampling-parameter validation: defaults, coercions, and errors that name the field."""

from __future__ import annotations

import pytest

from tandem.entrypoints.native_protocol import MAX_RID_LENGTH, GenerateReqInput
from tandem.sampling.sampling_params import SamplingParams


def test_defaults_and_coercions():
    p = SamplingParams.from_dict(None)
    assert p.max_new_tokens == 128 and p.temperature == 1.0 and p.top_k == -1 and not p.is_greedy
    p = SamplingParams.from_dict({"stop": "END", "stop_token_ids": 7, "temperature": 0})
    assert p.stop == ["END"] and p.stop_token_ids == [7] and p.is_greedy
    assert SamplingParams.from_dict({"top_k": 1}).is_greedy
    assert SamplingParams.from_dict({"max_new_tokens": None}).max_new_tokens == 128


@pytest.mark.parametrize(
    "params, field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
        ({"sampling_seed": "x"}, "sampling_seed"),
        ({"n": 0}, "n"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ],
)
def test_invalid_values_name_the_field(params, field):
    with pytest.raises(ValueError, match=f"sampling_params.{field}"):
        SamplingParams.from_dict(params)


def test_stop_token_ids_past_the_vocabulary_are_dropped():
    """As SGLang, which accepts them (its tests send Llama-3's ids to any model); negative ones are a 400."""
    p = SamplingParams.from_dict({"stop_token_ids": [99, 7, 119690]})
    p.normalize(vocab_size=100)
    assert p.stop_token_ids == [99, 7]
    with pytest.raises(ValueError, match="sampling_params.stop_token_ids: must be >= 0"):
        SamplingParams.from_dict({"stop_token_ids": [-1]})


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "text/input_ids"),
        ({"text": "a", "input_ids": [1]}, "text/input_ids"),
        ({"text": []}, "text"),
        ({"text": ["a", 3]}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, "2"]}, "input_ids"),
        ({"input_ids": [[1], []]}, "input_ids"),
        ({"text": "a", "stream": 1}, "stream"),
        ({"text": "a", "rid": ""}, "rid"),
        ({"text": "a", "sampling_params": [{}]}, "sampling_params"),
        ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
        ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"text": "a", "lora_path": 3}, "lora_path"),
        ({"text": ["a", "b"], "lora_path": ["x"]}, "lora_path"),
    ],
)
def test_generate_request_shape_errors(body, field):
    with pytest.raises(ValueError, match=field.replace("/", ".")):
        GenerateReqInput.from_json(body)


def test_batch_items_pick_their_own_params():
    obj = GenerateReqInput.from_json({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}], "rid": ["r1", "r2"]})
    assert obj.is_batch and obj.batch_size == 2
    second = obj.item(1)
    assert second.text == "b" and second.sampling_params == {"n": 2} and second.rid == "r2" and not second.is_batch


@pytest.mark.parametrize(
    "params, field, words",
    [
        ({"top_k": 2**63}, "top_k", "<= 9223372036854775807"),
        ({"max_new_tokens": 2**63}, "max_new_tokens", "<="),
        ({"sampling_seed": -(2**63) - 1}, "sampling_seed", ">="),
        ({"sampling_seed": 2**64}, "sampling_seed", "<="),
        ({"stop_token_ids": [2**63]}, "stop_token_ids", "<="),
        ({"n": 129}, "n", "<= 128"),
        ({"temperature": float("inf")}, "temperature", "finite"),
        ({"temperature": 10**400}, "temperature", "finite"),
        ({"top_p": float("nan")}, "top_p", "finite"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty", "finite"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty", "finite"),
        ({"min_p": float("nan")}, "min_p", "finite"),
    ],
)
def test_numbers_that_reach_tensors_are_bounded(params, field, words):
    with pytest.raises(ValueError, match=f"sampling_params.{field}: .*{words}"):
        SamplingParams.from_dict(params)


def test_error_messages_stay_short_for_huge_or_deep_values():
    deep: object = 1
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = [deep]
    for value in (deep, 10**5000, "x" * 1_000_000):
        with pytest.raises(ValueError) as e:
            SamplingParams.from_dict({"temperature": value})
        assert str(e.value).startswith("sampling_params.temperature: ") and len(str(e.value)) < 200


def test_top_k_past_the_vocabulary_means_all_of_it():
    p = SamplingParams.from_dict({"top_k": 2**63 - 1, "sampling_seed": -(2**63), "n": 128})
    p.normalize(vocab_size=100)
    assert p.top_k == 100
    p = SamplingParams.from_dict({"top_k": 5})
    p.normalize(vocab_size=100)
    assert p.top_k == 5


def test_rid_length_is_bounded():
    GenerateReqInput.from_json({"text": "a", "rid": "r" * MAX_RID_LENGTH})
    with pytest.raises(ValueError, match=f"rid: must be at most {MAX_RID_LENGTH} characters"):
        GenerateReqInput.from_json({"text": "a", "rid": "r" * (MAX_RID_LENGTH + 1)})
