"""Custom logit processors (--enable-custom-logit-processor) in SGLang's serialized form:
deserializing what SGLang's client class sends (its base class by reference to SGLang's
module, or everything by value from a client's script), and in-process schedulers on the
tiny model: a batch mixing two processors and none gives each request the tokens it gets
alone (normal and overlap loop), stateful processors keep their own state per request,
and a processor that raises ends only its own request."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import dill
import pytest
import torch
from scheduler_harness import SchedulerHarness
from sglang_client_stub import sglang_client, write_package

from tandem.entrypoints.native_protocol import GenerateReqInput
from tandem.messages import TokenizedGenerateReqInput
from tandem.sampling.custom_logit_processor import (
    SGLANG_MODULE,
    CustomLogitBatch,
    ProcessorReq,
    RequestProcessor,
    check_format,
    deserialize,
)
from tandem.sampling.sampling_params import SamplingParams


@pytest.fixture
def sglang_base(tmp_path):
    """`sglang.srt.sampling.custom_logit_processor.CustomLogitProcessor`, as a client with
    SGLang installed imports it (the server side has no sglang)."""
    with sglang_client(tmp_path) as base:
        yield base


def forcing_processor(base):
    """SGLang's test_srt_endpoint DeterministicLogitProcessor: row i samples params' token_id."""

    class DeterministicLogitProcessor(base):
        def __call__(self, logits, custom_param_list):
            assert logits.shape[0] == len(custom_param_list)
            for i, param_dict in enumerate(custom_param_list):
                logits[i, :] = -float("inf")
                logits[i, param_dict["token_id"]] = 0.0
            return logits

    return DeterministicLogitProcessor


def stateful_processor(base):
    """SGLang's DeterministicStatefulLogitProcessor: `delay` free tokens (counted down in
    the params dict), then token_id, then each time the previous output id + 1."""

    class DeterministicStatefulLogitProcessor(base):
        def __call__(self, logits, custom_param_list):
            assert logits.shape[0] == len(custom_param_list)
            for i, param_dict in enumerate(custom_param_list):
                if param_dict["delay"] > 0:
                    param_dict["delay"] -= 1
                    continue
                if param_dict["delay"] == 0:
                    param_dict["delay"] -= 1
                    force_token = param_dict["token_id"]
                else:
                    force_token = param_dict["__req__"].output_ids[-1] + 1
                logits[i, :] = -float("inf")
                logits[i, force_token] = 0.0
            return logits

    return DeterministicStatefulLogitProcessor


def counter_processor(base):
    """State on the instance: the n-th call forces token 20 + n (each request its own count)."""

    class Counter(base):
        def __init__(self):
            self.calls = 0

        def __call__(self, logits, custom_param_list):
            self.calls += 1
            logits[:, :] = -float("inf")
            logits[:, 20 + self.calls] = 0.0
            return logits

    return Counter


def raising_processor(base):
    """Raises once its request has 2 output tokens."""

    class Raising(base):
        def __call__(self, logits, custom_param_list):
            if len(custom_param_list[0]["__req__"].output_ids) >= 2:
                raise RuntimeError("boom from the client")
            return logits

    return Raising


# ---- the wire format ---------------------------------------------------------------


def test_sglang_base_class_is_resolved_to_tandems_module(sglang_base):
    cls = forcing_processor(sglang_base)
    serialized = cls.to_str()
    assert set(json.loads(serialized)) == {"callable"}
    raw = bytes.fromhex(json.loads(serialized)["callable"])
    assert SGLANG_MODULE.encode() in raw  # the base class travels by reference
    proc = deserialize(serialized)
    assert type(proc).__name__ == "DeterministicLogitProcessor"
    assert type(proc).__mro__[1].__module__ == "tandem.sampling.custom_logit_processor"
    out = proc(torch.zeros(2, 10), [{"token_id": 3}, {"token_id": 7}])
    assert out.argmax(-1).tolist() == [3, 7]
    # An instance's to_str (SGLang's examples call both) is the class's.
    assert cls().to_str() == serialized
    # Each deserialization is a fresh instance.
    assert deserialize(serialized) is not deserialize(serialized)


CLIENT_SCRIPT = textwrap.dedent(
    """
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor
    import torch

    class TorchUser(CustomLogitProcessor):
        def __call__(self, logits, custom_param_list):
            return torch.full_like(logits, -float("inf")).index_fill_(1, torch.tensor([4]), 1.0)

    print(TorchUser.to_str())
    """
)


def test_a_client_scripts_processor_loads_without_its_module(tmp_path):
    """A client script's class is pickled by value with __main__'s globals: they become a
    namespace with torch (the script's module does not exist in the server)."""
    write_package(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", CLIENT_SCRIPT], capture_output=True, text=True, check=True, cwd=str(tmp_path)
    )
    proc = deserialize(out.stdout.strip())
    assert type(proc).__mro__[1].__module__ == "tandem.sampling.custom_logit_processor"
    assert proc(torch.zeros(1, 8), [{}]).argmax(-1).tolist() == [4]


def test_builtin_sglang_processor_by_reference(sglang_base):
    """SGLang's own DisallowedTokensLogitsProcessor.to_str() pickles it by reference."""
    mod = sys.modules[SGLANG_MODULE]

    class DisallowedTokensLogitsProcessor(sglang_base):
        def __call__(self, logits, custom_param_list=None):
            raise AssertionError("the server's class runs, not this one")

    DisallowedTokensLogitsProcessor.__module__ = SGLANG_MODULE
    DisallowedTokensLogitsProcessor.__qualname__ = "DisallowedTokensLogitsProcessor"
    mod.DisallowedTokensLogitsProcessor = DisallowedTokensLogitsProcessor
    proc = deserialize(json.dumps({"callable": dill.dumps(DisallowedTokensLogitsProcessor).hex()}))
    logits = proc(torch.zeros(1, 6), [{"token_ids": [0, 1, 2]}])
    assert logits[0, :3].tolist() == [-float("inf")] * 3 and logits[0, 3:].tolist() == [0.0] * 3


@pytest.mark.parametrize("value", [5, "not json", "[]", '{"callable": 3}', '{"callable": "zz"}'])
def test_malformed_processors_are_refused_without_running_anything(value):
    with pytest.raises(ValueError, match="^custom_logit_processor"):
        check_format(value)


def test_generate_request_fields():
    obj = GenerateReqInput.from_json(
        {"text": ["a", "b"], "custom_logit_processor": ["x", None], "sampling_params": {"custom_params": {"k": 1}}}
    )
    assert obj.item(0).custom_logit_processor == "x" and obj.item(1).custom_logit_processor is None
    assert SamplingParams.from_dict({"custom_params": {"k": 1}}).custom_params == {"k": 1}
    with pytest.raises(ValueError, match="sampling_params.custom_params"):
        SamplingParams.from_dict({"custom_params": [1]})
    with pytest.raises(ValueError, match="custom_logit_processor: a list must have one entry per prompt"):
        GenerateReqInput.from_json({"text": ["a", "b"], "custom_logit_processor": ["x"]})


def test_batch_groups_rows_by_processor_and_records_failures(sglang_base):
    calls = []

    class Recording:
        def __init__(self, token):
            self.token = token

        def __call__(self, logits, params):
            calls.append(len(params))
            logits[:, :] = -float("inf")
            logits[:, self.token] = 0.0
            return logits

    shared = Recording(2)
    rows = [
        (0, "a", RequestProcessor(shared, {}), ProcessorReq("a", [1], [])),
        (2, "c", RequestProcessor(shared, {}), ProcessorReq("c", [1], [])),
        (3, "d", RequestProcessor(raising_processor(sglang_base)(), {}), ProcessorReq("d", [1], [5, 6])),
    ]
    batch = CustomLogitBatch.build(rows)
    logits = torch.zeros(4, 8)
    out = batch.apply(logits)
    assert calls == [2]  # one call for the rows sharing a processor
    assert out.argmax(-1).tolist()[:3] == [2, 0, 2]
    assert torch.equal(logits, torch.zeros(4, 8))  # the caller's logits are untouched
    assert torch.equal(out[3], torch.zeros(8)) and list(batch.failed) == [3]
    assert "boom from the client" in batch.failed[3]


# ---- in the scheduler ----------------------------------------------------------------

PROMPTS = [[5, 9, 13, 2, 8], [3, 4, 11], [17, 6, 6, 1, 2, 9, 30], [12, 12, 7, 3], [40, 2, 9]]


def submit(h: SchedulerHarness, rid: str, prompt: list[int], processor: str | None, params=None, n: int = 8):
    sp = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0, custom_params=params)
    h.io.inbox.append(
        TokenizedGenerateReqInput(
            rid=rid, input_ids=prompt, sampling_params=sp, stream=True, custom_logit_processor=processor
        )
    )


def run(model_dir, reqs, overlap: bool = False, **server_args) -> SchedulerHarness:
    h = SchedulerHarness(
        model_dir, disable_overlap_schedule=not overlap, enable_custom_logit_processor=True, **server_args
    )
    try:
        for rid, prompt, processor, params in reqs:
            submit(h, rid, prompt, processor, None if params is None else dict(params))
        h.run_until_idle()
        h.assert_memory_idle()
        return h
    finally:
        h.close()


def mixed_requests(base) -> list:
    force, stateful, counter = (p(base).to_str() for p in (forcing_processor, stateful_processor, counter_processor))
    return [
        ("force-5", PROMPTS[0], force, {"token_id": 5}),
        ("plain", PROMPTS[1], None, None),
        ("stateful", PROMPTS[2], stateful, {"token_id": 30, "delay": 2}),
        ("counter-a", PROMPTS[3], counter, None),
        ("counter-b", PROMPTS[4], counter, None),
        ("force-9", PROMPTS[1], force, {"token_id": 9}),
    ]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_mixed_batch_gives_each_request_its_tokens_alone(tiny_llama_dir, sglang_base, overlap):
    reqs = mixed_requests(sglang_base)
    together = run(tiny_llama_dir, reqs, overlap=overlap, chunked_prefill_size=6).collected
    ids = together.ids
    assert ids["force-5"] == [5] * 8 and ids["force-9"] == [9] * 8
    assert ids["stateful"][2:] == list(range(30, 36))  # after its 2 free tokens
    assert ids["counter-a"] == ids["counter-b"] == list(range(21, 29))  # each its own instance
    for req in reqs:
        alone = run(tiny_llama_dir, [req], overlap=overlap).collected
        assert alone.ids[req[0]] == ids[req[0]], req[0]
    assert all(f["type"] == "length" for f in together.finishes.values())


def test_overlap_and_normal_loop_agree(tiny_llama_dir, sglang_base):
    reqs = mixed_requests(sglang_base)
    normal = run(tiny_llama_dir, reqs, overlap=False).collected
    overlap = run(tiny_llama_dir, reqs, overlap=True).collected
    assert normal.ids == overlap.ids and normal.finishes == overlap.finishes


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_raising_processor_ends_only_its_request(tiny_llama_dir, sglang_base, overlap):
    reqs = mixed_requests(sglang_base)[:3] + [("raising", PROMPTS[3], raising_processor(sglang_base).to_str(), None)]
    h = run(tiny_llama_dir, reqs, overlap=overlap)
    finish = h.collected.finishes["raising"]
    assert finish["type"] == "abort" and finish["status_code"] == 400
    assert "RuntimeError: boom from the client" in finish["message"]
    assert len(h.collected.ids["raising"]) == 2  # the token of the failed step is not kept
    ok = run(tiny_llama_dir, reqs[:3], overlap=overlap).collected
    for rid, *_ in reqs[:3]:
        assert h.collected.ids[rid] == ok.ids[rid] and h.collected.finishes[rid]["type"] == "length"
    h.assert_released_once()


def test_unloadable_processor_and_disabled_flag_end_with_400(tiny_llama_dir, sglang_base):
    bad = json.dumps({"callable": b"not a pickle".hex()})
    h = run(tiny_llama_dir, [("bad", PROMPTS[0], bad, None), ("plain", PROMPTS[1], None, None)])
    assert h.collected.finishes["bad"]["status_code"] == 400
    assert "could not be deserialized" in h.collected.finishes["bad"]["message"]
    assert h.collected.finishes["plain"]["type"] == "length"
    off = SchedulerHarness(tiny_llama_dir, disable_overlap_schedule=True)
    try:
        submit(off, "off", PROMPTS[0], forcing_processor(sglang_base).to_str(), {"token_id": 5})
        finishes = off.run_until_idle()
    finally:
        off.close()
    assert finishes["off"]["status_code"] == 400 and "--enable-custom-logit-processor" in finishes["off"]["message"]
