"""Custom logit processors on a real server (--enable-custom-logit-processor), sent as
SGLang's client sends them (`CustomLogitProcessor.to_str()` of a class inheriting SGLang's
base, tests/sglang_client_stub.py): a processor that forces one token id makes greedy
output that token on /generate and the OpenAI routes; requests with different processors
and none share batches; the overlap loop, the normal loop and two TP ranks give the same
tokens; a processor that raises fails only its request; without the flag, a 400 naming it."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from http_helpers import wait_idle
from server_launcher import ServerHandle
from sglang_client_stub import sglang_client

PROMPT = "Question: Is Paris the Capital of France? Answer:"
FLAG = "--enable-custom-logit-processor"


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    """Serialized processors: force (params' token_id), stateful (SGLang's
    DeterministicStatefulLogitProcessor), raising."""
    with sglang_client(tmp_path_factory.mktemp("sglang_client")) as base:

        class DeterministicLogitProcessor(base):
            def __call__(self, logits, custom_param_list):
                assert logits.shape[0] == len(custom_param_list)
                for i, param_dict in enumerate(custom_param_list):
                    logits[i, :] = -float("inf")
                    logits[i, param_dict["token_id"]] = 0.0
                return logits

        class DeterministicStatefulLogitProcessor(base):
            def __call__(self, logits, custom_param_list):
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

        class Raising(base):
            def __call__(self, logits, custom_param_list):
                raise RuntimeError("boom from the client")

        yield {
            "force": DeterministicLogitProcessor.to_str(),
            "stateful": DeterministicStatefulLogitProcessor().to_str(),
            "raising": Raising.to_str(),
        }


def _server(model_dir, *args):
    return ServerHandle(model_dir, extra_args=[FLAG, "--skip-server-warmup", *args])


@pytest.fixture(scope="module")
def overlap_server(tiny_llama_dir):
    with _server(tiny_llama_dir, "--enable-overlap-schedule", "--chunked-prefill-size", "8") as handle:
        yield handle


@pytest.fixture(scope="module")
def normal_server(tiny_llama_dir):
    with _server(tiny_llama_dir, "--disable-overlap-schedule") as handle:
        yield handle


def _generate(base_url: str, processor: str | None = None, params: dict | None = None, n: int = 12) -> httpx.Response:
    body = {
        "text": PROMPT,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True},
        "return_logprob": True,
    }
    if processor is not None:
        body["custom_logit_processor"] = processor
        body["sampling_params"]["custom_params"] = params
    return httpx.post(base_url + "/generate", json=body, timeout=120)


def _ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    return [x[1] for x in meta["output_token_logprobs"]]


def _workload(base_url: str, processors: dict) -> dict:
    """SGLang's batch-mixed test and the stateful one, concurrently: rid -> output ids."""
    targets = list(range(3, 15)) + [None] * 6 + [("stateful", 40)] * 3
    random.Random(0).shuffle(targets)

    def one(target):
        if target is None:
            return _ids(_generate(base_url))
        if isinstance(target, tuple):
            return _ids(_generate(base_url, processors["stateful"], {"token_id": target[1], "delay": 2}))
        return _ids(_generate(base_url, processors["force"], {"token_id": target}))

    with ThreadPoolExecutor(len(targets)) as pool:
        return dict(zip(map(str, range(len(targets))), pool.map(one, targets))), targets


def _check_workload(results: dict, targets: list, plain: list[int]) -> None:
    for (_, ids), target in zip(results.items(), targets):
        if target is None:
            assert ids == plain
        elif isinstance(target, tuple):
            assert ids[2:] == list(range(target[1], target[1] + len(ids) - 2)), ids
        else:
            assert ids == [target] * len(ids)


@pytest.mark.parametrize("which", ["overlap_server", "normal_server"])
def test_forced_token_in_mixed_batches(request, which, processors):
    server = request.getfixturevalue(which)
    assert _ids(_generate(server.base_url, processors["force"], {"token_id": 5})) == [5] * 12
    plain = _ids(_generate(server.base_url))
    results, targets = _workload(server.base_url, processors)
    _check_workload(results, targets, plain)
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        wait_idle(c)


def test_overlap_and_normal_loop_give_the_same_tokens(overlap_server, normal_server, processors):
    for proc, params in (("force", {"token_id": 7}), ("stateful", {"token_id": 30, "delay": 2}), (None, None)):
        assert _ids(_generate(overlap_server.base_url, processors.get(proc), params)) == _ids(
            _generate(normal_server.base_url, processors.get(proc), params)
        )


def test_openai_routes_take_sglangs_extra_body(overlap_server, processors):
    forced = httpx.post(
        overlap_server.base_url + "/generate",
        json={
            "text": PROMPT,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "custom_params": {"token_id": 9}},
            "custom_logit_processor": processors["force"],
        },
        timeout=60,
    ).json()["text"]
    extra = {"custom_logit_processor": processors["force"], "custom_params": {"token_id": 9}}
    with httpx.Client(base_url=overlap_server.base_url + "/v1", timeout=60) as c:
        r = c.post("/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == forced
        messages = [{"role": "user", "content": "Hi"}]
        r = c.post("/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == forced
        assert r.json()["usage"]["completion_tokens"] == 4


def test_a_raising_processor_fails_only_its_request(normal_server, processors):
    with ThreadPoolExecutor(3) as pool:
        bad = pool.submit(_generate, normal_server.base_url, processors["raising"], {})
        good = [pool.submit(_generate, normal_server.base_url, processors["force"], {"token_id": 4}) for _ in range(2)]
        r = bad.result()
        assert r.status_code == 400, r.text
        assert "RuntimeError: boom from the client" in r.text
        assert all(_ids(g.result()) == [4] * 12 for g in good)
    r = _generate(normal_server.base_url, '{"callable": "00"}', {})
    assert r.status_code == 400 and "could not be deserialized" in r.text
    assert _ids(_generate(normal_server.base_url, processors["force"], {"token_id": 6})) == [6] * 12


def test_without_the_flag_a_400_names_it(client, processors):
    r = client.post(
        "/generate",
        json={"text": PROMPT, "custom_logit_processor": processors["force"], "sampling_params": {"max_new_tokens": 2}},
    )
    assert r.status_code == 400 and FLAG in r.text, r.text
    body = {"messages": [{"role": "user", "content": "Hi"}], "custom_logit_processor": processors["force"]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and FLAG in r.text, r.text


def test_two_tp_ranks_give_the_same_tokens(tiny_llama_dir, normal_server, processors):
    with _server(tiny_llama_dir, "--tp-size", "2") as tp2:
        for proc, params in (("force", {"token_id": 7}), ("stateful", {"token_id": 30, "delay": 2})):
            assert _ids(_generate(tp2.base_url, processors[proc], params)) == _ids(
                _generate(normal_server.base_url, processors[proc], params)
            )
        r = _generate(tp2.base_url, processors["raising"], {})
        assert r.status_code == 400 and "boom" in r.text
        assert _ids(_generate(tp2.base_url, processors["force"], {"token_id": 3})) == [3] * 12


def test_offline_engine_takes_the_processor(tiny_llama_dir, processors):
    from tandem import Engine

    with Engine(model_path=str(tiny_llama_dir), enable_custom_logit_processor=True, skip_server_warmup=True) as eng:
        params = {"temperature": 0, "max_new_tokens": 5, "custom_params": {"token_id": 8}}
        out = eng.generate(PROMPT, params, custom_logit_processor=processors["force"])
        assert out["output_ids"] == [8] * 5
        outs = eng.generate([PROMPT, PROMPT], params, custom_logit_processor=[processors["force"], None])
        assert outs[0]["output_ids"] == [8] * 5 and outs[1]["output_ids"] != [8] * 5
