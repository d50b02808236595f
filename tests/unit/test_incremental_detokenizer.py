"""Tests for tandem.detokenizer.incremental_detokenizer.

Two small tokenizers are trained here from an embedded corpus (deterministic, <1 s):
  * "sp": SentencePiece-style BPE, Metaspace "▁", byte_fallback with <0x00>..<0xFF>,
    decoders Replace/ByteFallback/Fuse/Strip (drops the leading space of a fragment).
  * "bl": GPT-2 style byte-level BPE.
Characters outside their small vocabularies (emoji, most CJK) are split across byte
tokens, which is what the UTF-8 holdback has to handle.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tandem.detokenizer.incremental_detokenizer import IncrementalDetokenizer, byte_fallback_token_ids
from tandem.messages import DetokenizeParams
from tandem.scheduler.schedule_batch import INIT_INCREMENTAL_DETOKENIZATION_OFFSET

FFFD = "\ufffd"

CORPUS = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "User: what is the answer?\n\nAssistant: forty two.\n\nUser: thanks",
    "你好，世界！今天天气很好。",
    "café naïve résumé über",
    "def main():\n    return 42\n",
    "stop words END here, and then some more words.",
] * 3

SP_SPECIALS = ["<unk>", "<s>", "</s>"]
BL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _build_sp() -> PreTrainedTokenizerFast:
    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    base = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    base.pre_tokenizer = meta
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SP_SPECIALS, limit_alphabet=60, show_progress=False)
    base.train_from_iterator(CORPUS, trainer)
    # Rebuild with the 256 byte tokens as ordinary (non-special) vocabulary entries.
    trained = sorted(base.get_vocab().items(), key=lambda kv: kv[1])
    merges = json.loads(base.to_str())["model"]["merges"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]
    vocab = {t: i for i, t in enumerate(SP_SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for tok, _ in trained:
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = meta
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SP_SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _build_bl() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=BL_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", additional_special_tokens=BL_SPECIALS[1:]
    )


TOKENIZERS = {"sp": _build_sp(), "bl": _build_bl()}


@pytest.fixture(params=["sp", "bl"])
def tok(request):
    return TOKENIZERS[request.param]


@pytest.fixture
def sp():
    return TOKENIZERS["sp"]


def params(stop=(), no_stop_trim=False, skip=True, spaces=True, stream=True, prompt=()) -> DetokenizeParams:
    """DetokenizeParams; `prompt` ids are cut to their tail as Req.detokenize_params does."""
    return DetokenizeParams(
        skip_special_tokens=skip,
        spaces_between_special_tokens=spaces,
        stop=list(stop),
        no_stop_trim=no_stop_trim,
        stream=stream,
        prompt_tail=list(prompt)[-INIT_INCREMENTAL_DETOKENIZATION_OFFSET:],
    )


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run(
    tokenizer,
    p: DetokenizeParams,
    chunks: list[list[int]],
    finish: dict | None = None,
    byte_ids: frozenset[int] = frozenset(),
):
    """Feed chunks one step each, the last one with `finish`; return (deltas, outputs)."""
    d = IncrementalDetokenizer(tokenizer, p, byte_ids)
    deltas, outputs = [], []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        delta = d.step(chunk, finish if last else None)
        deltas.append(delta)
        outputs.append(d.output_text)
        assert d.output_text == "".join(deltas)
    return deltas, outputs


def one_per_step(ids):
    return [[i] for i in ids]


def stop_safe(text: str, stops: list[str]) -> str:
    """Reference holdback: cut at the first full stop, then at a trailing stop prefix."""
    cut = len(text)
    for s in stops:
        p = text.find(s)
        if p != -1:
            cut = min(cut, p)
        for k in range(len(s) - 1, 0, -1):
            if text.endswith(s[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut]


# --------------------------------------------------------------- hypothesis

ALPHABET = (
    "abcdeHlowrd xyz  \n\t.,!?:"  # ascii, spaces, newlines
    "你好世界天气今很"  # CJK in the corpus
    "猫狗龍"  # CJK not in the corpus (byte fallback)
    "éïüñ"  # latin-1 supplement
    "😀🎉👍🏽"  # 4-byte emoji, one with a modifier
    "Привет"
)


@st.composite
def id_sequences(draw, tokenizer, allow_random_ids=True):
    """Ids from encoded random text segments, optionally mixed with arbitrary vocab ids."""
    segments = draw(
        st.lists(
            st.one_of(
                st.text(alphabet=ALPHABET, max_size=12).map(lambda t: ("text", t)),
                st.integers(0, len(tokenizer) - 1).map(lambda i: ("id", i)) if allow_random_ids else st.nothing(),
            ),
            min_size=1,
            max_size=8,
        )
    )
    ids: list[int] = []
    for kind, value in segments:
        ids.extend(enc(tokenizer, value) if kind == "text" else [value])
    return ids


@st.composite
def chunked(draw, ids):
    """Split ids into steps of random sizes (possibly empty steps)."""
    chunks, i = [], 0
    while i < len(ids):
        n = draw(st.integers(0, 4))
        chunks.append(ids[i : i + n])
        i += n
    chunks.append(ids[i:] if i < len(ids) else [])
    return chunks


HSET = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@pytest.mark.parametrize("name", ["sp", "bl"])
@HSET
@given(data=st.data(), skip=st.booleans(), spaces=st.booleans())
def test_property_matches_full_decode(name, data, skip, spaces):
    tokenizer = TOKENIZERS[name]
    ids = data.draw(id_sequences(tokenizer))
    chunks = data.draw(chunked(ids))
    p = params(skip=skip, spaces=spaces)
    deltas, outputs = run(tokenizer, p, chunks, {"type": "length", "length": len(ids)})
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    if FFFD in full:
        # Invalid UTF-8 somewhere: only require that nothing breaks and all was flushed.
        assert outputs[-1] == "".join(deltas)
        return
    assert "".join(deltas) == full
    assert not any(FFFD in d for d in deltas)
    # Liveness: after each running step at least the complete-character prefix of the
    # decode so far has been emitted.
    n = 0
    for chunk, out in zip(chunks[:-1], outputs[:-1]):
        n += len(chunk)
        lower = tokenizer.decode(ids[:n], skip_special_tokens=skip).rstrip(FFFD)
        assert full.startswith(out)
        assert len(out) >= len(lower), (out, lower)


@pytest.mark.parametrize("name", ["sp", "bl"])
@HSET
@given(data=st.data())
def test_property_stop_strings(name, data):
    tokenizer = TOKENIZERS[name]
    ids = data.draw(id_sequences(tokenizer, allow_random_ids=False))
    full = tokenizer.decode(ids, skip_special_tokens=True)
    # Stop strings: substrings of the actual text (so they match, often across tokens)
    # and a few arbitrary short strings.
    substr = st.integers(0, max(len(full) - 1, 0)).flatmap(lambda a: st.integers(a + 1, a + 6).map(lambda b: full[a:b]))
    stops = data.draw(
        st.lists(st.one_of(substr, st.text(alphabet="ab \n你😀", min_size=1, max_size=4)), min_size=1, max_size=3)
    )
    stops = [s for s in stops if s] or ["zz"]
    matched = data.draw(st.sampled_from(stops))
    chunks = data.draw(chunked(ids))
    deltas, outputs = run(tokenizer, params(stop=stops), chunks, {"type": "stop", "matched": matched})
    pos = full.find(matched)
    expected = full[:pos] if pos != -1 else full
    assert "".join(deltas) == expected
    n = 0
    for chunk, out in zip(chunks[:-1], outputs[:-1]):
        n += len(chunk)
        # Never emit anything that the final trim could take back.
        assert expected.startswith(out)
        assert full.startswith(out)
        lower = stop_safe(tokenizer.decode(ids[:n], skip_special_tokens=True).rstrip(FFFD), stops)
        assert len(out) >= len(lower), (out, lower, stops)


@pytest.mark.parametrize("name", ["sp", "bl"])
@HSET
@given(data=st.data())
def test_property_no_stop_trim_emits_everything(name, data):
    tokenizer = TOKENIZERS[name]
    ids = data.draw(id_sequences(tokenizer, allow_random_ids=False))
    full = tokenizer.decode(ids)
    stop = data.draw(st.text(alphabet="ab \n.", min_size=1, max_size=3))
    chunks = data.draw(chunked(ids))
    deltas, _ = run(tokenizer, params(stop=[stop], no_stop_trim=True), chunks, {"type": "stop", "matched": stop})
    assert "".join(deltas) == full


# ------------------------------------------------------------- fixed cases


def test_tokenizers_split_characters_into_byte_tokens():
    sp, bl = TOKENIZERS["sp"], TOKENIZERS["bl"]
    toks = sp.convert_ids_to_tokens(enc(sp, "😀"))
    assert toks[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert len(enc(bl, "😀")) >= 2
    assert len(enc(bl, "猫")) >= 2


@pytest.mark.parametrize("text", ["😀", "猫", "a猫b", "你好 😀 猫狗🎉!", "👍🏽👍🏽", "Привет мир"])
def test_split_characters_never_emit_replacement(tok, text):
    ids = enc(tok, text)
    deltas, outputs = run(tok, params(), one_per_step(ids) + [[]], {"type": "length"})
    full = tok.decode(ids)
    assert "".join(deltas) == full
    assert not any(FFFD in d for d in deltas)
    # Each character appears as soon as its last byte arrived. (With byte fallback,
    # decode(ids[:n]) turns a whole run of byte tokens into U+FFFD while its last
    # character is incomplete; the detokenizer, decoding from its window, may emit the
    # complete characters of that run earlier, hence >=.)
    for n, out in enumerate(outputs[:-1], start=1):
        assert full.startswith(out)
        assert len(out) >= len(tok.decode(ids[:n]).rstrip(FFFD))


def test_emoji_bytes_held_until_complete(sp):
    ids = enc(sp, "a😀")
    byte_ids = ids[-4:]
    assert sp.convert_ids_to_tokens(byte_ids) == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    d = IncrementalDetokenizer(sp, params())
    assert d.step(ids[:-4], None) == "a"
    assert d.step(byte_ids[:1], None) == ""
    assert d.step(byte_ids[1:3], None) == ""
    assert d.step(byte_ids[3:], None) == "😀"
    assert d.step([], {"type": "length"}) == ""
    assert d.output_text == "a😀"


def test_text_before_incomplete_character_in_same_step_is_emitted(sp):
    ids = enc(sp, "Hello world😀")
    d = IncrementalDetokenizer(sp, params())
    assert d.step(ids[:-2], None) == "Hello world"  # ends with 2 of the 4 emoji bytes
    assert d.step(ids[-2:], None) == "😀"


def test_leading_spaces_sentencepiece(sp):
    text = "Hello world, the quick brown fox"
    ids = enc(sp, text)
    assert sp.convert_ids_to_tokens(ids)[0].startswith("▁")
    # Decoding a fragment alone loses its leading space; the detokenizer must not.
    frag = [i for i in ids if sp.convert_ids_to_tokens(i).startswith("▁")][1]
    assert not sp.decode([frag]).startswith(" ")
    deltas, _ = run(sp, params(), one_per_step(ids) + [[]], {"type": "length"})
    assert "".join(deltas) == text
    assert sum(d.startswith(" ") for d in deltas) >= 3


def test_leading_space_kept_after_skipped_special_token(sp):
    ids = enc(sp, "Hello") + [sp.bos_token_id] + enc(sp, " world")
    full = sp.decode(ids, skip_special_tokens=True)
    deltas, _ = run(sp, params(), one_per_step(ids) + [[]], {"type": "length"})
    assert "".join(deltas) == full == "Hello world"


def test_cost_per_step_is_bounded(tok):
    calls: list[int] = []

    class Spy:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tok.decode(ids, **kw)

    ids = enc(tok, "the quick brown fox jumps over the lazy dog. " * 20)
    deltas, _ = run(Spy(), params(), one_per_step(ids) + [[]], {"type": "length"})
    assert "".join(deltas) == tok.decode(ids)
    assert len(ids) > 50
    assert max(calls) <= 4
    assert len(calls) <= 2 * len(ids) + 2


def test_stop_string_spanning_tokens_is_held_back(tok):
    text = "Assistant: forty two.\n\nUser: thanks"
    ids = enc(tok, text)
    stop = "\n\nUser"
    d = IncrementalDetokenizer(tok, params(stop=[stop]))
    seen = []
    for i in ids:
        d.step([i], None)
        seen.append(d.output_text)
        pending = tok.decode(ids[: len(seen)])
        assert "\n" not in d.output_text
        assert pending.startswith(d.output_text)
    # Once "\n\nUs" (or any prefix of the stop) is pending, it was held back.
    assert all(o == "Assistant: forty two." for o in seen if len(o) >= len("Assistant: forty two."))
    assert d.step([], {"type": "stop", "matched": stop}) == ""
    assert d.output_text == "Assistant: forty two."


def test_stop_prefix_released_when_not_a_stop(tok):
    ids = enc(tok, "stop words END here")
    d = IncrementalDetokenizer(tok, params(stop=["ENDX"]))
    for n in range(1, len(ids) + 1):
        d.step([ids[n - 1]], None)
        pending = tok.decode(ids[:n])
        assert d.output_text == stop_safe(pending, ["ENDX"])
    assert d.output_text == "stop words END here"
    d.step([], {"type": "length"})
    assert d.output_text == "stop words END here"


def test_full_stop_string_before_scheduler_reports(tok):
    ids = enc(tok, "stop words END here, and")
    d = IncrementalDetokenizer(tok, params(stop=["END"]))
    assert d.step(ids, None) == "stop words "
    assert d.step(enc(tok, " more"), None) == ""
    assert d.step([], {"type": "stop", "matched": "END"}) == ""
    assert d.output_text == "stop words "


def test_stop_trim_cuts_at_first_occurrence(tok):
    ids = enc(tok, "a. b. c.")
    deltas, _ = run(tok, params(stop=[". "]), one_per_step(ids), {"type": "stop", "matched": ". "})
    assert "".join(deltas) == "a"


def test_no_stop_trim_keeps_stop_string(tok):
    text = "Assistant: forty two.\n\nUser: thanks"
    ids = enc(tok, text)
    stop = "\n\nUser"
    d = IncrementalDetokenizer(tok, params(stop=[stop], no_stop_trim=True))
    for n, i in enumerate(ids, start=1):
        d.step([i], None)
        # No holdback needed: the stop string stays in the final text.
        assert d.output_text == tok.decode(ids[:n]).rstrip(FFFD)
    d.step([], {"type": "stop", "matched": stop})
    assert d.output_text == text


def test_stop_token_id_skipped(tok):
    eos = tok.eos_token_id
    ids = enc(tok, "Hello world") + [eos]
    deltas, _ = run(tok, params(), one_per_step(ids), {"type": "stop", "matched": eos})
    assert "".join(deltas) == "Hello world"


def test_stop_token_id_trimmed_when_special_tokens_kept(tok):
    # SGLang's trim_matched_stop drops the stop id itself unless no_stop_trim.
    eos = tok.eos_token_id
    ids = enc(tok, "Hello world") + [eos]
    deltas, _ = run(tok, params(skip=False), [ids], {"type": "stop", "matched": eos})
    assert "".join(deltas) == "Hello world"
    deltas, _ = run(tok, params(skip=False, no_stop_trim=True), [ids], {"type": "stop", "matched": eos})
    assert "".join(deltas) == "Hello world" + tok.eos_token


def test_non_special_stop_token_id(sp):
    ids = enc(sp, "Hello world.")
    stop_id = ids[-1]
    deltas, _ = run(sp, params(), one_per_step(ids), {"type": "stop", "matched": stop_id})
    assert "".join(deltas) == sp.decode(ids[:-1])


def test_special_tokens_kept_without_spaces(tok):
    specials = tok.all_special_ids
    ids = [specials[1]] + enc(tok, "Hello") + specials + enc(tok, " world")
    for spaces in (False, True):
        deltas, _ = run(tok, params(skip=False, spaces=spaces), one_per_step(ids), {"type": "length"})
        out = "".join(deltas)
        assert out == tok.decode(ids, skip_special_tokens=False)
        assert "".join(tok.convert_ids_to_tokens(specials)) in out  # joined without spaces
    deltas, _ = run(tok, params(skip=True), one_per_step(ids), {"type": "length"})
    assert "".join(deltas) == "Hello world"


def test_invalid_utf8_at_end_flushed_on_finish(sp):
    lone = sp.convert_tokens_to_ids("<0xE4>")
    ids = enc(sp, "Hello") + [lone]
    d = IncrementalDetokenizer(sp, params())
    assert d.step(ids, None) == "Hello"
    assert d.step([], {"type": "length"}) == FFFD
    assert d.output_text == "Hello" + FFFD


def test_split_character_completed_in_final_step(tok):
    ids = enc(tok, "猫")
    d = IncrementalDetokenizer(tok, params())
    assert d.step(ids[:1], None) == ""
    assert d.step(ids[1:], {"type": "length"}) == "猫"


def test_steps_after_finish_are_ignored(tok):
    d = IncrementalDetokenizer(tok, params())
    d.step(enc(tok, "Hello"), {"type": "abort", "message": "x"})
    assert d.step(enc(tok, " world"), None) == ""
    assert d.output_text == "Hello"


def test_empty_and_non_stream(tok):
    d = IncrementalDetokenizer(tok, params(stream=False))
    assert d.step([], None) == ""
    assert d.step([], {"type": "length"}) == ""
    assert d.output_text == ""


def test_tiny_model_tokenizer(tmp_path):
    """The project's own tiny model's tokenizer (SentencePiece-style, byte fallback for the
    CJK and the emoji): streamed one id a step, with and without the byte ids the
    detokenizer process passes, the text is the full decode; a stop string inside an
    emoji's bytes cuts the text before it. make_tiny_model is part of Tandem: if it
    fails, this test fails."""
    from transformers import AutoTokenizer

    from tandem.tools.make_tiny_model import make_tiny_model

    make_tiny_model(tmp_path, arch="llama")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello world 你好 😀 猫"
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full == text  # byte fallback round-trips every character
    for byte_ids in (frozenset(), byte_fallback_token_ids(tokenizer)):
        deltas, _ = run(tokenizer, params(), one_per_step(ids), {"type": "length"}, byte_ids)
        assert "".join(deltas) == text
        assert not any(FFFD in d for d in deltas)
        deltas, _ = run(tokenizer, params(stop=["😀"]), one_per_step(ids), {"type": "stop", "matched": "😀"}, byte_ids)
        assert "".join(deltas) == "Hello world 你好 "


@pytest.mark.parametrize("name", ["sp", "bl"])
@HSET
@given(data=st.data())
def test_property_streamed_text_equals_full_decode_even_for_invalid_utf8(name, data):
    """With the tokenizer's byte-fallback ids known (as the detokenizer process passes
    them), token-by-token output equals the full decode whatever the bytes, valid or not:
    a streamed response always ends on the same text as a non-streamed one."""
    tokenizer = TOKENIZERS[name]
    byte_ids = sorted(byte_fallback_token_ids(tokenizer))
    pieces = data.draw(
        st.lists(
            st.one_of(
                st.text(alphabet=ALPHABET, max_size=6).map(lambda t: enc(tokenizer, t)),
                st.lists(st.sampled_from(byte_ids), min_size=1, max_size=4) if byte_ids else st.just([]),
            ),
            min_size=1,
            max_size=8,
        )
    )
    ids = [i for piece in pieces for i in piece]
    d = IncrementalDetokenizer(tokenizer, params(), frozenset(byte_ids))
    streamed = "".join(d.step([i], None) for i in ids) + d.step([], {"type": "length"})
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)
    if name == "sp":
        assert byte_ids, "the SentencePiece test tokenizer has byte-fallback tokens"


# ------------------------------------------------- the prompt's tail as context
#
# decode(prompt) + output text == decode(prompt + output ids): on the two tokenizers
# above, on the converted stories260K tokenizer (SentencePiece, byte fallback, BOS), and
# on the tiny models' tokenizers (llama: SentencePiece-style with byte fallback; qwen2:
# byte-level).


@pytest.fixture(scope="module", params=["sp", "bl", "stories_dir", "tiny_llama_dir", "tiny_qwen2_dir"])
def any_tok(request):
    if request.param in TOKENIZERS:
        return TOKENIZERS[request.param]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(request.getfixturevalue(request.param))


@pytest.fixture(scope="module")
def stories_tok(stories_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories_dir)


def test_first_output_piece_keeps_its_space(stories_tok):
    """The issue's case: "Tom had a" then "▁big ▁box" is " big box", not "big box"."""
    prompt = stories_tok.encode("Tom had a")
    full = stories_tok.encode("Tom had a big box")
    assert full[: len(prompt)] == prompt and prompt[0] == stories_tok.bos_token_id
    out = full[len(prompt) :]
    assert stories_tok.decode(out) == "big box"  # what decoding the output alone gives
    for chunks in ([out], one_per_step(out) + [[]]):
        deltas, _ = run(stories_tok, params(prompt=prompt), chunks, {"type": "length"})
        assert "".join(deltas) == " big box"
    deltas, _ = run(
        stories_tok, params(prompt=prompt, stop=[" box"]), one_per_step(out), {"type": "stop", "matched": " box"}
    )
    assert "".join(deltas) == " big"


@pytest.mark.parametrize("skip", [True, False])
@HSET
@given(data=st.data())
def test_property_prompt_then_output_is_decode_of_all_ids(any_tok, skip, data):
    prompt = data.draw(id_sequences(any_tok))
    out = data.draw(id_sequences(any_tok))
    chunks = data.draw(chunked(out))
    head = any_tok.decode(prompt, skip_special_tokens=skip)
    full = any_tok.decode(prompt + out, skip_special_tokens=skip)
    byte_ids = byte_fallback_token_ids(any_tok)
    deltas, outputs = run(any_tok, params(skip=skip, prompt=prompt), chunks, {"type": "length"}, byte_ids)
    if FFFD in head or FFFD in full:
        return  # the prompt or the whole is not valid UTF-8: no text to compare with
    assert head + "".join(deltas) == full
    assert all(full.startswith(head + o) for o in outputs)


@HSET
@given(data=st.data())
def test_property_prompt_tail_with_stop_strings(any_tok, data):
    prompt = data.draw(id_sequences(any_tok, allow_random_ids=False))
    out = data.draw(id_sequences(any_tok, allow_random_ids=False))
    head = any_tok.decode(prompt, skip_special_tokens=True)
    text = any_tok.decode(prompt + out, skip_special_tokens=True)[len(head) :]
    stop = (
        data.draw(
            st.integers(0, max(len(text) - 1, 0)).flatmap(lambda a: st.integers(a + 1, a + 4).map(lambda b: text[a:b]))
        )
        or "zz"
    )
    chunks = data.draw(chunked(out))
    no_trim = data.draw(st.booleans())
    deltas, outputs = run(
        any_tok,
        params(stop=[stop], no_stop_trim=no_trim, prompt=prompt),
        chunks,
        {"type": "stop", "matched": stop},
        byte_fallback_token_ids(any_tok),
    )
    if FFFD in head + text:
        return
    expected = text if no_trim or stop not in text else text[: text.find(stop)]
    assert "".join(deltas) == expected
    assert all(expected.startswith(o) for o in outputs)


def test_prompt_tail_cut_inside_a_character(sp):
    """A tail that starts inside a byte-fallback character must not garble an output
    character that continues the byte run."""
    prompt = enc(sp, "a猫😀")  # byte tokens: 猫 3, 😀 4
    assert len(prompt) > INIT_INCREMENTAL_DETOKENIZATION_OFFSET
    out = enc(sp, "猫")[-3:]
    assert sp.convert_ids_to_tokens(out) == ["<0xE7>", "<0x8C>", "<0xAB>"]
    byte_ids = byte_fallback_token_ids(sp)
    deltas, _ = run(sp, params(prompt=prompt), one_per_step(out) + [[]], {"type": "length"}, byte_ids)
    assert "".join(deltas) == "猫"
