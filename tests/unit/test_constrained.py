"""Constrained decoding (tandem/constrained) in-process: the grammar checks and compile
cache, then a real Scheduler on the random-weight tiny model (scheduler_harness), where
no output would match a grammar by chance. Every output of a fixed, varied set of JSON
schemas and regexes fully matches, greedy and seeded-sampled, with the overlap loop and
the normal loop giving the same tokens, under chunked prefill, mixed chunks, penalties,
several samples of one grammar, retraction and without the radix cache; on each grammar
backend (xgrammar, llguidance, outlines: outlines has no EBNF)."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
from scheduler_harness import SchedulerHarness, loop_configurations
from test_overlap_schedule import assert_same, prompts, run

from tandem.constrained.backend import create_grammar_backend
from tandem.constrained.grammar_key import parse_grammar, verify_grammar
from tandem.sampling.sampling_params import SamplingParams
from tandem.utils.tokenizer import load_tokenizer

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": -5, "maximum": 500},
        },
        "required": ["color", "n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
                },
                "required": ["name", "tags"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["user", "ok"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -1, "maximum": 1},
            "code": {"type": "string", "pattern": "^[0-9]{3}-[a-f]{2}$"},
            "empty": {"type": "null"},
        },
        "required": ["x", "code", "empty"],
        "additionalProperties": False,
    },
    {"enum": ["yes", "no", 42, None]},
]
# Digits as [0-9], not \d: llguidance and outlines read \d as any Unicode digit of a newer
# Unicode than Python's re (a sampled "\U0001ccf4", OUTLINED DIGIT FOUR of Unicode 16, met
# the grammar and failed re.fullmatch).
REGEXES = [
    r"(cat|dog|bird)s?",
    r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)",
    r"[0-9]{3}-[0-9]{4}",
    r"(0|[1-9][0-9]{0,3})\.[0-9]{1,2}",
    r"[A-Z][a-z]{0,4}( [A-Z][a-z]{0,4}){1,2}",
]
EBNF = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= [a-c] | "x" [0-9]'
SERVER_ARGS = {"constrained_json_disable_any_whitespace": True}
BACKENDS = ["xgrammar", "llguidance", "outlines"]


def _backend_configurations():
    """Every loop configuration on xgrammar; the defaults and retraction on the others."""
    params = []
    for backend in BACKENDS:
        for config in loop_configurations(small_pool_tokens=120):
            if backend == "xgrammar" or config.id in ("default", "small-pool"):
                params.append(pytest.param(backend, config.values[0], id=f"{backend}-{config.id}"))
    return params


def without_numeric_bounds(node):
    """A schema without the numeric bounds that outlines refuses."""
    if isinstance(node, list):
        return [without_numeric_bounds(x) for x in node]
    if not isinstance(node, dict):
        return node
    return {k: without_numeric_bounds(v) for k, v in node.items() if k not in ("minimum", "maximum")}


def constrained_workload(backend: str = "xgrammar") -> list[tuple[str, list[int], dict]]:
    """(rid, prompt, fields): every schema and regex greedy and seeded-sampled, an EBNF
    (where the backend has EBNF), three samples of one schema, penalties, logprobs.
    Outlines gets the schemas without their numeric bounds (it refuses them)."""
    p = prompts(30, seed=5)
    reqs = []
    schemas = [without_numeric_bounds(s) for s in SCHEMAS] if backend == "outlines" else SCHEMAS
    for i, schema in enumerate(schemas):
        reqs.append((f"json-{i}", p[i], {"json_schema": json.dumps(schema)}))
        # top_k 50 at 0.9, as the regexes: outlines' schemas have no numeric bounds, and at
        # temperature 1 over the whole vocabulary a sampled integer ran past max_new_tokens
        reqs.append(
            (
                f"json-{i}-sampled",
                p[i + 5],
                {"json_schema": json.dumps(schema), "temperature": 0.9, "top_k": 50, "sampling_seed": 11 + i},
            )
        )
    for i, regex in enumerate(REGEXES):
        reqs.append((f"regex-{i}", p[10 + i], {"regex": regex}))
        reqs.append(
            (f"regex-{i}-sampled", p[15 + i], {"regex": regex, "temperature": 0.9, "top_k": 50, "sampling_seed": 3 + i})
        )
    if backend != "outlines":
        reqs.append(("ebnf", p[20], {"ebnf": EBNF, "temperature": 1.0, "sampling_seed": 1}))
    reqs += [
        (f"n-{k}", p[21], {"json_schema": json.dumps(schemas[1]), "temperature": 1.0, "sampling_seed": 40 + k})
        for k in range(3)
    ]
    reqs.append(
        (
            "penalties",
            p[22],
            {
                "json_schema": json.dumps(schemas[2]),
                "temperature": 0.8,
                "sampling_seed": 9,
                "frequency_penalty": 1.0,
                "presence_penalty": 0.5,
                "repetition_penalty": 1.5,
            },
        )
    )
    reqs.append(
        (
            "logprobs",
            p[23],
            {"json_schema": json.dumps(schemas[0]), "logprobs": {"return_logprob": True, "top_logprobs_num": 3}},
        )
    )
    reqs.append(("plain", p[24], {"max_new_tokens": 20}))
    return [(rid, ids, {"max_new_tokens": 120, "ignore_eos": False, **fields}) for rid, ids, fields in reqs]


def assert_all_match(h: SchedulerHarness, reqs) -> None:
    """Every constrained request finished on its grammar's end and its text matches."""
    tok = h.scheduler.tokenizer
    for rid, _, fields in reqs:
        text = tok.decode(h.collected.ids[rid], skip_special_tokens=True)
        if "json_schema" in fields:
            assert h.collected.finishes[rid]["type"] == "stop", (rid, text)
            jsonschema.validate(json.loads(text), json.loads(fields["json_schema"]))
        elif "regex" in fields:
            assert h.collected.finishes[rid]["type"] == "stop", (rid, text)
            assert re.fullmatch(fields["regex"], text), (rid, text)
        elif "ebnf" in fields:
            assert re.fullmatch(r"\((?:[a-c]|x\d)(?:,(?:[a-c]|x\d)){0,2}\)", text), text


@pytest.mark.parametrize(("backend", "server_args"), _backend_configurations())
def test_outputs_match_their_grammar_in_both_loops(tiny_llama_dir, backend, server_args):
    reqs = constrained_workload(backend)
    small_pool = "max_total_tokens" in server_args
    # under a small pool, all are admitted at once (compiled first) so that it must retract
    args = {"grammar_backend": backend, "wait_for_grammars": small_pool, **SERVER_ARGS, **server_args}
    normal = run(tiny_llama_dir, False, reqs, **args)
    overlap = run(tiny_llama_dir, True, reqs, **args)
    assert_all_match(normal, reqs)
    assert_same(normal, overlap)
    if small_pool:
        assert sum(normal.collected.retractions.values()) > 0, "the pool was not small enough to retract"


def test_staggered_arrivals_match(tiny_llama_dir):
    reqs = constrained_workload()[::3]
    normal = run(tiny_llama_dir, False, reqs, stagger=2, **SERVER_ARGS)
    assert_all_match(normal, reqs)
    assert_same(normal, run(tiny_llama_dir, True, reqs, stagger=2, **SERVER_ARGS))


def test_logprobs_are_of_the_raw_distribution(tiny_llama_dir):
    """The first token of an object schema can only be '{': masked, its logprob would be 0."""
    reqs = [r for r in constrained_workload() if r[0] == "logprobs"]
    h = run(tiny_llama_dir, False, reqs, **SERVER_ARGS)
    (token_logprobs, top_logprobs, _, _), *_ = h.collected.logprobs["logprobs"]
    first_logprob, first_id = token_logprobs[0]
    assert h.scheduler.tokenizer.decode([first_id]).strip() == "{"
    assert first_logprob < -0.01
    assert all(lp <= 0 for lp, _ in top_logprobs[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fields", [{"ignore_eos": True}, {"min_new_tokens": 8, "ignore_eos": False}])
def test_grammar_end_finishes_with_stop(tiny_llama_dir, fields, backend):
    """The grammar's end (its EOS accepted) finishes the request, even with ignore_eos or
    before min_new_tokens (which never bans the EOS a grammar needs)."""
    reqs = [("r", prompts(1)[0], {"regex": "ab", "max_new_tokens": 50, **fields})]
    h = run(tiny_llama_dir, True, reqs, grammar_backend=backend, **SERVER_ARGS)
    eos = sorted(h.scheduler.finish_checker.eos_token_ids)
    assert h.collected.finishes["r"] == {"type": "stop", "matched": h.collected.ids["r"][-1]}
    assert h.collected.ids["r"][-1] in eos
    assert h.scheduler.tokenizer.decode(h.collected.ids["r"][:-1]) == "ab"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_grammar_in_the_scheduler_is_a_400(tiny_llama_dir, backend):
    """A grammar that reaches the scheduler unchecked (the tokenizer manager checks first)
    ends its request alone with a 400 naming the problem; a queued one can be aborted."""
    h = SchedulerHarness(tiny_llama_dir, grammar_backend=backend)
    try:
        h.submit("bad", regex="[a-")
        h.submit("good", regex="x{3}", ignore_eos=False, max_new_tokens=10)
        h.submit("aborted", json_schema='{"type": "string", "maxLength": 3}')
        h.abort("aborted")
        h.run_until_idle()
        bad = h.collected.finishes["bad"]
        assert bad["type"] == "abort" and bad["status_code"] == 400
        assert bad["message"].startswith("sampling_params.regex: invalid regex: "), bad
        assert backend != "xgrammar" or "'['" in bad["message"]
        assert h.collected.finishes["aborted"]["type"] == "abort"
        assert h.scheduler.tokenizer.decode(h.collected.ids["good"], skip_special_tokens=True) == "xxx"
        h.assert_memory_idle()
    finally:
        h.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_compile_cache_is_keyed_by_kind_and_value(tiny_llama_dir, name):
    tok = load_tokenizer(str(tiny_llama_dir))
    backend = create_grammar_backend(name, tok, len(tok) + 64, [tok.eos_token_id])  # a padded model vocabulary
    assert backend.name == name and backend.vocab_size == len(tok) + 64
    a = backend.compile(("regex", "a+"))
    assert backend.compile(("regex", "a+")) is a
    assert backend.compile(("json_schema", "a+")) is not a
    a.result(timeout=30)
    with pytest.raises(ValueError, match="sampling_params.json_schema: invalid json_schema"):
        backend.compile(("json_schema", "{nope")).result(timeout=30)


def _compile_threads() -> set[int]:
    return {t.native_id for t in threading.enumerate() if t.name.startswith("grammar-compile")}


def test_the_compile_thread_starts_with_the_backend(tiny_llama_dir):
    """Not at the first grammar: a thread started then by a scheduler's bound forward thread
    would share that thread's CPU (tandem/utils/cpu_threads.py, "Placement")."""
    tok = load_tokenizer(str(tiny_llama_dir))
    before = _compile_threads()
    backend = create_grammar_backend("xgrammar", tok, len(tok), [tok.eos_token_id])
    started = _compile_threads() - before
    assert len(started) == 1
    backend.compile(("regex", "a+")).result(timeout=30)
    backend.compile(("regex", "b+")).result(timeout=30)
    assert _compile_threads() - before == started, "the grammars compiled on that thread"


@pytest.mark.parametrize(
    "key,message",
    [
        (
            ("json_schema", '{"type": "foo"}'),
            'sampling_params.json_schema: invalid json_schema: Unsupported type "foo"',
        ),
        (("json_schema", "{not json"), "sampling_params.json_schema: invalid json_schema: Failed to parse JSON"),
        (("regex", "(ab"), "sampling_params.regex: invalid regex: "),
        (("ebnf", 'root ::= "a" |'), "sampling_params.ebnf: invalid ebnf: EBNF parser error"),
    ],
)
def test_invalid_grammars_name_the_problem(key, message):
    with pytest.raises(ValueError) as e:
        parse_grammar(key)
    assert str(e.value).startswith(message), str(e.value)
    assert "/project/" not in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "backend,key,message",
    [
        ("llguidance", ("json_schema", '{"type": "foo"}'), "sampling_params.json_schema: invalid json_schema: "),
        ("llguidance", ("json_schema", "{not json"), "sampling_params.json_schema: invalid json_schema: "),
        ("llguidance", ("regex", "(ab"), "sampling_params.regex: invalid regex: "),
        ("llguidance", ("ebnf", 'root ::= "a" ('), "sampling_params.ebnf: invalid ebnf: "),
        ("outlines", ("json_schema", '{"type": "foo"}'), "sampling_params.json_schema: invalid json_schema: "),
        ("outlines", ("json_schema", "{not json"), "sampling_params.json_schema: invalid json_schema: "),
        ("outlines", ("regex", "(ab"), "sampling_params.regex: invalid regex: "),
        ("outlines", ("ebnf", 'root ::= "a"'), "sampling_params.ebnf: the outlines grammar backend"),
        (
            "outlines",
            ("json_schema", json.dumps(SCHEMAS[2])),
            "sampling_params.json_schema: the outlines grammar backend (--grammar-backend outlines) does not "
            "honour 'minimum'",
        ),
    ],
)
def test_each_backend_checks_grammars_with_its_own_parser(backend, key, message):
    with pytest.raises(ValueError) as e:
        verify_grammar(key, backend, True, True)
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)
    for good in [("regex", "a+"), ("json_schema", '{"type": "string"}')]:
        verify_grammar(good, backend, True, True)
    if backend != "outlines":
        verify_grammar(("ebnf", 'root ::= "a"'), backend, True, True)


def test_grammar_backend_none_and_no_tokenizer_refuse():
    with pytest.raises(
        ValueError,
        match=r"sampling_params.regex: structured output is disabled on this server "
        r"\(--grammar-backend none\)",
    ):
        verify_grammar(("regex", "a"), "none", True, True)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        verify_grammar(("regex", "a"), "xgrammar", False, True)
    verify_grammar(("regex", "a"), "xgrammar", True, True)


def test_sampling_params_grammar_fields():
    sp = SamplingParams.from_dict({"json_schema": {"type": "string"}, "regex": "", "ebnf": None})
    assert sp.grammar_key() == ("json_schema", '{"type": "string"}')
    assert SamplingParams.from_dict({}).grammar_key() is None
    with pytest.raises(
        ValueError, match=r"only one of regex, json_schema, or ebnf can be set \(got json_schema and regex\)"
    ):
        SamplingParams.from_dict({"json_schema": "{}", "regex": "a"})
    with pytest.raises(ValueError, match="sampling_params.regex: must be a string"):
        SamplingParams.from_dict({"regex": 5})


STAG_SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["n"],
    "additionalProperties": False,
}
# xgrammar's structural tag: a tag around a JSON object; the legacy shape: free text until a trigger.
STAG_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<f>",
        "content": {"type": "json_schema", "json_schema": STAG_SCHEMA, "max_whitespace_cnt": 1},
        "end": "</f>",
    },
}
STAG_LEGACY = {"structures": [{"begin": "<f=a>", "schema": STAG_SCHEMA, "end": "</f>"}], "triggers": ["<f"]}


def test_structural_tags_constrain_the_output_in_both_loops(tiny_llama_dir):
    """xgrammar's structural tags (a const string; a tag around a JSON schema), greedy and
    sampled: each output is exactly what the tag allows, then EOS."""
    const = {"type": "structural_tag", "format": {"type": "const_string", "value": "The capital is Berlin."}}
    p = prompts(3, seed=8)
    reqs = [
        ("const", p[0], {"structural_tag": json.dumps(const)}),
        ("tag", p[1], {"structural_tag": json.dumps(STAG_TAG)}),
        ("tag-sampled", p[2], {"structural_tag": json.dumps(STAG_TAG), "temperature": 1.0, "sampling_seed": 4}),
    ]
    reqs = [(rid, ids, {"max_new_tokens": 80, "ignore_eos": False, **f}) for rid, ids, f in reqs]
    normal = run(tiny_llama_dir, False, reqs, **SERVER_ARGS)
    tok = normal.scheduler.tokenizer
    texts = {rid: tok.decode(normal.collected.ids[rid], skip_special_tokens=True) for rid, _, _ in reqs}
    assert texts["const"] == "The capital is Berlin.", texts
    for rid in ("tag", "tag-sampled"):
        assert normal.collected.finishes[rid]["type"] == "stop", texts
        m = re.fullmatch(r"<f>(.*)</f>", texts[rid], re.S)
        assert m, texts[rid]
        jsonschema.validate(json.loads(m.group(1)), STAG_SCHEMA)
    assert_same(normal, run(tiny_llama_dir, True, reqs, **SERVER_ARGS))


def _allowed_texts(backend, grammar, tok) -> list[str]:
    """The text of each token the grammar allows next."""
    mask = torch.zeros((1, (backend.vocab_size + 31) // 32), dtype=torch.int32)
    grammar.fill_row(mask, 0)
    return [tok.decode([i]) for i in range(len(tok)) if (int(mask[0, i // 32]) >> (i % 32)) & 1]


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_legacy_structural_tag_is_free_text_until_a_trigger(tiny_llama_dir, name):
    """The legacy shape (SGLang's `structures` and `triggers`) on both backends that have it:
    any text before the trigger; after a structure's `begin`, only its JSON schema."""
    tok = load_tokenizer(str(tiny_llama_dir))
    backend = create_grammar_backend(name, tok, len(tok), [tok.eos_token_id])
    grammar = backend.make_grammar(backend.compile(("structural_tag", json.dumps(STAG_LEGACY))).result(timeout=60))
    free = _allowed_texts(backend, grammar, tok)
    assert len(free) > len(tok) // 2 and "<" in free
    ids = tok.encode('Hi <f=a>{"n": 1}</f>', add_special_tokens=False)
    split = next(k for k in range(len(ids)) if tok.decode(ids[:k]) == "Hi <f=a>")
    for tid in ids[:split]:
        grammar.accept_token(tid)
    inside = _allowed_texts(backend, grammar, tok)
    assert "{" in inside and all(t.strip() in ("", "{") for t in inside), inside
    for tid in ids[split:]:
        grammar.accept_token(tid)
    assert len(_allowed_texts(backend, grammar, tok)) > len(tok) // 2  # free text again


@pytest.mark.parametrize(
    "backend,tag,message",
    [
        (
            "xgrammar",
            {"type": "structural_tag", "format": {"type": "bogus"}},
            "invalid structural_tag: Format type not recognized: bogus",
        ),
        ("xgrammar", {"type": "structural_tag"}, "invalid structural_tag: needs 'format'"),
        ("xgrammar", {**STAG_LEGACY, "triggers": ["<x"]}, "invalid structural_tag: One tag does not match any trigger"),
        (
            "xgrammar",
            {**STAG_LEGACY, "structures": [{"begin": "<f", "schema": {"type": "foo"}, "end": ""}]},
            'invalid structural_tag: Unsupported type "foo"',
        ),
        ("xgrammar", [1], "invalid structural_tag: must be a JSON object"),
        (
            "llguidance",
            {**STAG_LEGACY, "triggers": ["<x"]},
            "invalid structural_tag: structures[0].begin starts with no trigger",
        ),
        (
            "llguidance",
            {**STAG_LEGACY, "structures": []},
            "invalid structural_tag: 'structures' must be a non-empty list",
        ),
        (
            "llguidance",
            STAG_TAG,
            "the llguidance grammar backend (--grammar-backend llguidance) has no structural tag 'format'",
        ),
        ("outlines", STAG_LEGACY, "the outlines grammar backend (--grammar-backend outlines) has no structural_tag"),
    ],
)
def test_bad_structural_tags_are_named(backend, tag, message):
    with pytest.raises(ValueError) as e:
        verify_grammar(("structural_tag", json.dumps(tag)), backend, True, True)
    assert str(e.value).startswith(f"sampling_params.structural_tag: {message}"), str(e.value)
    if backend != "outlines":
        verify_grammar(("structural_tag", json.dumps(STAG_LEGACY)), backend, True, True)


def test_structural_tag_sampling_param():
    assert SamplingParams.from_dict({"structural_tag": STAG_TAG}).grammar_key() == (
        "structural_tag",
        json.dumps(STAG_TAG),
    )
    assert SamplingParams.from_dict({"structural_tag": ""}).grammar_key() is None
    with pytest.raises(ValueError, match=r"sampling_params: structural_tag cannot be combined with regex"):
        SamplingParams.from_dict({"structural_tag": "{}", "regex": "a"})
