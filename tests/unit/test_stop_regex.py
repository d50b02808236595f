"""stop_regex (SGLang's): parsed and validated with the sampling params, matched by the
finish check on the output's tail (the finish names the pattern, as SGLang's), and held
back by the detokenizer while the text could still grow into a match."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tandem.detokenizer.incremental_detokenizer import IncrementalDetokenizer
from tandem.messages import DetokenizeParams
from tandem.sampling.sampling_params import SamplingParams
from tandem.scheduler.finish_check import FinishChecker, regex_window
from tandem.scheduler.schedule_batch import Req

STORY = " Tom had a big red box and a ball. He was happy"


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    return AutoTokenizer.from_pretrained(stories_dir)


def test_parsed_as_sglang():
    assert SamplingParams.from_dict({"stop_regex": "and|or"}).stop_regex == ["and|or"]
    assert SamplingParams.from_dict({"stop_regex": ["a", "b+"]}).stop_regex == ["a", "b+"]
    assert SamplingParams.from_dict({"stop_regex": None}).stop_regex == []
    assert SamplingParams.from_dict({"stop_regex": ""}).stop_regex == []
    for bad, text in (("[a-", "sampling_params.stop_regex: invalid regex"), (3, "sampling_params.stop_regex: must be")):
        with pytest.raises(ValueError, match=text.replace(".", r"\.")):
            SamplingParams.from_dict({"stop_regex": bad})


def test_window():
    assert regex_window("and|or") == 4 * 3 + 1
    assert regex_window(r"\d+") > 10**9  # unbounded: the whole output


def _first_stop(tokenizer, output: str, stop_regex: list[str], prompt: str = "Once upon a time"):
    checker = FinishChecker(tokenizer, eos_token_ids={2})
    prompt_ids = tokenizer.encode(prompt)
    out_ids = tokenizer.encode(prompt + output)[len(prompt_ids) :]
    req = Req("r", prompt_ids, SamplingParams(max_new_tokens=100, stop_regex=stop_regex))
    for i in out_ids:
        req.output_ids.append(i)
        finish = checker.check(req)
        if finish is not None:
            return req.output_ids, finish
    return req.output_ids, None


def test_finish_names_the_pattern(tokenizer):
    ids, finish = _first_stop(tokenizer, STORY, ["and|or"])
    assert finish == {"type": "stop", "matched": "and|or"}
    assert tokenizer.decode(ids).endswith("and")
    ids, finish = _first_stop(tokenizer, STORY, [r"[.!?]\s*$"])
    assert finish == {"type": "stop", "matched": r"[.!?]\s*$"} and tokenizer.decode(ids).endswith("ball.")
    ids, finish = _first_stop(tokenizer, STORY, [r"b[a-z]+l+"])  # "ball", not "big"/"box"
    assert finish["matched"] == r"b[a-z]+l+" and tokenizer.decode(ids).endswith("ball")
    assert _first_stop(tokenizer, STORY, ["zebra", r"\d"])[1] is None


def _stream(tokenizer, ids: list[int], finish: dict | None, stop_regex: list[str], no_stop_trim: bool = False):
    params = DetokenizeParams(
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        stop=[],
        no_stop_trim=no_stop_trim,
        stream=True,
        prompt_tail=tokenizer.encode("Once upon a time")[-5:],
        stop_regex=stop_regex,
    )
    d = IncrementalDetokenizer(tokenizer, params)
    prefixes = []
    for k, i in enumerate(ids):
        d.step([i], finish if k == len(ids) - 1 else None)
        prefixes.append(d.output_text)
    return prefixes


@pytest.mark.parametrize(
    "pattern,cut_before",
    [("and|or", "and"), (r"[.!?]\s*$", "."), (r"b[a-z]+l+", "ball"), (r"box\s+and", "box and")],
)
def test_streamed_text_never_shows_the_match(tokenizer, pattern, cut_before):
    ids, finish = _first_stop(tokenizer, STORY, [pattern])
    prefixes = _stream(tokenizer, ids, finish, [pattern])
    final = prefixes[-1]
    full = STORY
    assert full.startswith(final + cut_before), (final, cut_before)
    for p in prefixes:  # every streamed prefix is a prefix of the final text
        assert final.startswith(p)
    # no_stop_trim: the match is shown, and the text is everything decoded.
    kept = _stream(tokenizer, ids, finish, [pattern], no_stop_trim=True)[-1]
    assert STORY.startswith(kept) and kept.endswith(cut_before)


def test_holdback_is_released_when_no_match_can_follow(tokenizer):
    """ " a" could start "and": held back until " big" shows it cannot."""
    ids, _ = _first_stop(tokenizer, " Tom had a big red box", ["and"])
    prefixes = _stream(tokenizer, ids, None, ["and"])
    assert prefixes[-1] == " Tom had a big red box"[: len(prefixes[-1])]
    assert " Tom had a big" in prefixes[-1] or prefixes[-1].startswith(" Tom had a big")
