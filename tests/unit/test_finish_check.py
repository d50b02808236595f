"""FinishChecker's stop strings on a SentencePiece tokenizer (stories260K): the output's
first piece keeps its leading space, as in the text the client gets."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tandem.sampling.sampling_params import SamplingParams
from tandem.scheduler.finish_check import FinishChecker
from tandem.scheduler.schedule_batch import Req


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    return AutoTokenizer.from_pretrained(stories_dir)


def _first_stop(checker, tokenizer, prompt: str, output: str, stop: list[str]):
    """Feed `output`'s ids one by one; return (number of ids fed, finish) at the first finish."""
    prompt_ids = tokenizer.encode(prompt)
    out_ids = tokenizer.encode(prompt + output)[len(prompt_ids) :]
    req = Req("r", prompt_ids, SamplingParams(max_new_tokens=100, stop=stop))
    for i in out_ids:
        req.output_ids.append(i)
        finish = checker.check(req)
        if finish is not None:
            return len(req.output_ids), finish
    return len(req.output_ids), None


def test_stop_string_with_leading_space_matches_first_output_piece(tokenizer):
    checker = FinishChecker(tokenizer, eos_token_ids={2})
    assert tokenizer.decode(tokenizer.encode("Tom had a big box")[5:6]) == "big"  # alone: no space
    assert _first_stop(checker, tokenizer, "Tom had a", " big box", [" big"]) == (
        1,
        {"type": "stop", "matched": " big"},
    )
    # Later in the output (context from the output itself), and no match on prompt text.
    assert _first_stop(checker, tokenizer, "Tom had a", " big red box", [" box"])[1] == {
        "type": "stop",
        "matched": " box",
    }
    assert _first_stop(checker, tokenizer, "Tom had a", " big red box", ["Tom", " had"])[1] is None
