"""Speculative decoding (tandem/speculative), in-process on the tiny model: greedy and
seeded outputs, logprobs and finishes equal with and without speculation, alone and in
mixed batches, for NGRAM and STANDALONE (a draft model of other weights: mostly
rejected; the target itself as draft: every greedy draft accepted); memory idle after;
the verify step's rejection sampling keeps the target's distribution (chi-square);
bad flags stop the start naming the problem."""

from __future__ import annotations

import random

import pytest
import torch
from scheduler_harness import SchedulerHarness

from tandem.layers.sampler import Sampler, SamplingBatchInfo
from tandem.sampling.sampling_params import SamplingParams
from tandem.server_args import ServerArgs
from tandem.speculative.ngram import NgramProposer
from tandem.speculative.verify import verify_drafts

STORIES = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom and his dog",
    "One day, a big bird",
    "The sun was hot. The sun was hot. The sun was",
    "Sam had a red ball. He liked to play with his red ball. One day, Sam",
    "Mia and Ben went to the park.",
]


def workload(prompts: list[list[int]]) -> list[tuple[str, list[int], dict]]:
    """(rid, prompt, fields): greedy requests of several lengths, a stop token, EOS,
    logprobs, a seeded sampled request, on six prompts."""
    reqs = [(f"plain-{i}", p, {"max_new_tokens": 20 + 15 * i}) for i, p in enumerate(prompts[:4])]
    reqs += [
        (
            "logprobs",
            prompts[4],
            {
                "max_new_tokens": 30,
                "logprobs": {"return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [5, 9]},
            },
        ),
        ("seeded", prompts[5], {"max_new_tokens": 40, "temperature": 0.9, "top_k": 30, "sampling_seed": 7}),
        ("eos", prompts[1], {"max_new_tokens": 200, "ignore_eos": False}),
        ("stop-id", prompts[0], {"max_new_tokens": 60, "stop_token_ids": [13]}),
    ]
    return reqs


def random_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 9, 17, 30, 7, 12)]


PENALIZED = ("penalties", [4, 5, 6, 7, 8], {"max_new_tokens": 10, "frequency_penalty": 0.5})


def run(model_dir, reqs, **server_args) -> SchedulerHarness:
    h = SchedulerHarness(model_dir, disable_overlap_schedule=True, **server_args)
    h.last_records = {}  # each request's last record (its speculative counts)
    send = h.io.send_output

    def keep_last(out) -> None:
        h.last_records.update((rec.rid, rec) for rec in out.outputs)
        send(out)

    h.io.send_output = keep_last
    try:
        for rid, ids, fields in reqs:
            fields = dict(fields)
            h.submit(rid, input_ids=ids, stream=True, logprobs=fields.pop("logprobs", None), **fields)
        h.run_until_idle()
        h.assert_memory_idle()
        h.assert_released_once()
        assert set(h.collected.finishes) == {r[0] for r in reqs}
        return h
    finally:
        h.close()


def flat_logprobs(h: SchedulerHarness) -> dict[str, list]:
    """Each request's output logprobs over its records: (logprob, id) pairs, and per
    position its top and chosen-id pairs."""
    out = {}
    for rid, records in h.collected.logprobs.items():
        chosen = [pair for rec in records for pair in rec[0]]
        tops = [pairs for rec in records for pairs in rec[1]]
        by_id = [pairs for rec in records for pairs in rec[2] or []]
        out[rid] = (chosen, tops + by_id)
    return out


def assert_pairs_close(a: list, b: list) -> None:
    assert [int(t) for _, t in a] == [int(t) for _, t in b]
    assert [v for v, _ in a] == pytest.approx([v for v, _ in b], abs=1e-4)


def assert_same(a: SchedulerHarness, b: SchedulerHarness) -> None:
    """Same tokens, finishes and counts; same logprobs (to float noise: a verify forward
    computes them in an EXTEND forward, a decode step in a DECODE one)."""
    assert a.collected.ids == b.collected.ids
    assert a.collected.finishes == b.collected.finishes
    assert a.collected.completion_tokens == b.collected.completion_tokens
    la, lb = flat_logprobs(a), flat_logprobs(b)
    assert la.keys() == lb.keys()
    for rid in la:
        assert_pairs_close(la[rid][0], lb[rid][0])
        assert len(la[rid][1]) == len(lb[rid][1])
        for x, y in zip(la[rid][1], lb[rid][1]):
            assert_pairs_close(x, y)


@pytest.fixture(scope="module")
def stories_reqs(stories_dir) -> list:
    from tandem.utils.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(stories_dir))
    return workload([tokenizer.encode(text) for text in STORIES])


@pytest.fixture(scope="module")
def stories_baseline(stories_dir, stories_reqs):
    return run(stories_dir, stories_reqs + [PENALIZED])


@pytest.mark.slow
@pytest.mark.parametrize(
    "server_args",
    [
        pytest.param({"max_total_tokens": 400, "chunked_prefill_size": 16}, id="small-pool-chunked"),
        pytest.param({"disable_radix_cache": True}, id="no-radix"),
    ],
)
def test_ngram_same_outputs(stories_dir, stories_reqs, stories_baseline, server_args):
    spec = run(stories_dir, stories_reqs, speculative_algorithm="NGRAM", **server_args)
    assert_same(_only(stories_baseline, {r[0] for r in stories_reqs}), spec)
    s = spec.scheduler.spec
    assert s.accepted > 20 and s.proposed > s.accepted  # drafts accepted, and some rejected


def test_ngram_mixed_with_a_penalized_request(stories_dir, stories_reqs, stories_baseline):
    """A request that does not speculate shares some steps: those are plain decodes."""
    spec = run(stories_dir, stories_reqs + [PENALIZED], speculative_algorithm="NGRAM")
    assert_same(stories_baseline, spec)
    s = spec.scheduler.spec
    assert s.accepted > 20 and s.proposed > s.accepted
    # meta_info's counts: each verify step gives its accepted drafts + 1 tokens (the first from the prefill).
    records = spec.last_records.values()
    for rec in records:
        assert rec.completion_tokens == 1 + rec.spec_verify_ct + rec.spec_accept_token_num, rec.rid
        assert rec.spec_accept_token_num <= rec.spec_draft_token_num
    assert sum(r.spec_accept_token_num for r in records) == s.accepted
    assert sum(r.spec_draft_token_num for r in records) == s.proposed
    assert spec.last_records["penalties"].spec_draft_token_num == 0
    assert spec.scheduler.control.server_state("x").spec_accepted_tokens == s.accepted


def test_ngram_abort_while_running(stories_dir, stories_reqs):
    """An abort that arrives between verify steps ends the request at its next result,
    with its KV released once."""
    h = SchedulerHarness(stories_dir, disable_overlap_schedule=True, speculative_algorithm="NGRAM")
    try:
        rid, ids, _ = stories_reqs[0]
        h.submit(rid, stream=True, input_ids=ids, max_new_tokens=150)
        while len(h.collected.ids[rid]) < 20 and h.step():
            pass
        assert h.scheduler.spec.verify_steps > 0 and rid not in h.collected.finishes
        h.abort(rid)
        h.run_until_idle()
        assert h.collected.finishes[rid]["type"] == "abort"
        assert len(h.collected.ids[rid]) < 150
        h.assert_memory_idle()
        h.assert_released_once()
    finally:
        h.close()


@pytest.mark.slow
def test_standalone_same_outputs(tiny_llama_dir, tiny_llama_b_dir):
    reqs = [(rid, p, {**f, "max_new_tokens": min(f["max_new_tokens"], 16)}) for rid, p, f in workload(random_prompts())]
    baseline = run(tiny_llama_dir, reqs)
    other = run(
        tiny_llama_dir, reqs, speculative_algorithm="STANDALONE", speculative_draft_model_path=str(tiny_llama_b_dir)
    )
    assert_same(baseline, other)
    s = other.scheduler.spec
    assert s.proposed > 40 and s.accepted < 0.5 * s.proposed  # another model: mostly rejected
    greedy = [r for r in reqs if r[0] != "seeded"]
    itself = run(
        tiny_llama_dir,
        greedy,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(tiny_llama_dir),
        speculative_num_steps=4,
        max_total_tokens=100,
    )
    assert_same(_only(baseline, {r[0] for r in greedy}), itself)
    s = itself.scheduler.spec
    assert s.proposed > 40 and s.accepted == s.proposed  # the target itself: every greedy draft accepted


def _only(h: SchedulerHarness, rids: set[str]) -> SchedulerHarness:
    """A view of `h`'s collected outputs restricted to `rids` (for assert_same)."""
    view = SchedulerHarness.__new__(SchedulerHarness)
    c = type(h.collected)()
    for name in ("ids", "logprobs", "finishes", "completion_tokens"):
        getattr(c, name).update({rid: v for rid, v in getattr(h.collected, name).items() if rid in rids})
    view.collected = c
    return view


def test_ngram_proposer():
    p = NgramProposer(min_window=2, max_window=4)
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]  # suffix 1 2 3 recurs
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3], 1) == [4]
    assert p.propose([5, 6, 7, 8], 3) == []  # no suffix recurs
    assert p.propose([7, 7, 7], 2) == [7]  # the latest earlier occurrence of (7, 7)
    # A misaligned byte match (id 256 packs as 00 01 00 00) is not a token match.
    assert NgramProposer(1, 1).propose([256, 1, 0, 0, 1], 2) == [0, 0]


# Chi-square critical value for 7 degrees of freedom at false-alarm rate 1e-3 (per check;
# the seeds are fixed, so the test is deterministic: the rate is that of a seed choice).
CHI2_7DOF_1E3 = 24.32


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft", ["point-mass", "draft-model"])
def test_verify_keeps_the_target_distribution(draft):
    """A vocabulary of 8 tokens, target distributions p0, p1 at the two verified positions,
    draft d1 (and, for the draft model, its distribution q0): the first output token is
    distributed as p0, and the second (produced when d1 was accepted) as p1."""
    vocab, n = 8, 20000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, vocab, generator=g) * 1.5
    p = torch.softmax(logits, dim=-1)
    d1 = int(p[0].argmax())  # a likely draft: accepted often enough to test the second position
    info = SamplingBatchInfo([SamplingParams(temperature=1.0)] * n, [0] * n, vocab, "cpu")
    rows = logits.repeat(n, 1)
    q = None
    if draft == "draft-model":
        q0 = torch.softmax(torch.randn(vocab, generator=g), dim=-1)
        q = torch.stack([q0, torch.zeros(vocab)]).repeat(n, 1)
        drafts = torch.multinomial(q0, n, replacement=True, generator=g).tolist()
        draft_ids = [[d] for d in drafts]
    else:
        draft_ids = [[d1]] * n
    out = verify_drafts(rows, info, Sampler(1, "cpu"), draft_ids, q)
    tokens = out.token_ids.tolist()
    firsts, seconds, at = [], [], 0
    for a in out.accept_lens:
        firsts.append(tokens[at])
        if a == 1:
            seconds.append(tokens[at + 1])
        at += a + 1
    first_counts = torch.bincount(torch.tensor(firsts), minlength=vocab).float()
    second_counts = torch.bincount(torch.tensor(seconds), minlength=vocab).float()
    assert len(seconds) > 2000
    assert _chi_square(first_counts, p[0]) < CHI2_7DOF_1E3
    assert _chi_square(second_counts, p[1]) < CHI2_7DOF_1E3
    # And the test can fail: the first tokens are not distributed as the draft's choice alone.
    assert _chi_square(first_counts, torch.softmax(logits[0] * 2, dim=-1)) > CHI2_7DOF_1E3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm EAGLE: is not built"),
        ({"speculative_algorithm": "MEDUSA"}, "--speculative-algorithm MEDUSA: is unknown"),
        ({"speculative_algorithm": "STANDALONE"}, "needs --speculative-draft-model-path"),
        ({"speculative_draft_model_path": "/x"}, "needs --speculative-algorithm STANDALONE"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, "must be >= 2"),
        ({"speculative_algorithm": "NGRAM", "disable_overlap_schedule": False}, "normal loop only"),
        ({"speculative_algorithm": "NGRAM", "tp_size": 2}, "not built with --tp-size"),
    ],
)
def test_bad_flags(tiny_llama_dir, flags, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path=str(tiny_llama_dir), device="cpu", **flags).validate()


def test_draft_model_with_another_vocabulary(tiny_llama_dir, stories_dir):
    args = ServerArgs(
        model_path=str(tiny_llama_dir),
        device="cpu",
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(stories_dir),
    )
    with pytest.raises(ValueError, match=r"--speculative-draft-model-path .*: its vocabulary \(512 tokens\) differs"):
        args.validate()
