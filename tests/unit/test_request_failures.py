"""One request cannot crash a process (docs/architecture.md, "Failure handling"): an exception
while handling one request's input or output ends that request with an error finish and
leaves the component serving; its KV is released exactly once. A failing forward stays
fatal. Each component runs in-process on real sockets; a request is poisoned with a value
the HTTP boundary would refuse."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import zmq
from scheduler_harness import SchedulerHarness

from tandem.detokenizer.detokenizer_manager import DetokenizerManager
from tandem.entrypoints.native_protocol import GenerateReqInput
from tandem.messages import (
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizeParams,
    ReqOutput,
    TokenizedGenerateReqInput,
)
from tandem.server_args import PortArgs, ServerArgs
from tandem.tokenizer.tokenizer_manager import TokenizerManager
from tandem.utils import zmq_io


@pytest.fixture
def port_args():
    args = PortArgs.create()
    yield args
    shutil.rmtree(args.ipc_dir, ignore_errors=True)


def pull(endpoint: str) -> zmq.Socket:
    return zmq_io.make_socket(zmq.Context.instance(), zmq.PULL, endpoint, bind=True)


def drain(sock: zmq.Socket, quiet_ms: int = 200) -> list:
    """Every message that arrives until none has come for `quiet_ms`."""
    out = []
    while sock.poll(quiet_ms):
        out.extend(zmq_io.recv_nowait(sock))
    return out


def assert_error_finish(reason: dict, where: str, exc_name: str) -> None:
    assert reason["type"] == "abort" and reason["status_code"] == 500, reason
    assert reason["message"].startswith(f"internal error while {where}: {exc_name}"), reason


# ---- scheduler ------------------------------------------------------------------------
@pytest.fixture(params=["overlap", "normal"])
def harness(tiny_llama_dir, request):
    h = SchedulerHarness(tiny_llama_dir, disable_overlap_schedule=request.param == "normal")
    yield h
    h.close()


GOOD = {"type": "length", "length": 6}


def test_scheduler_request_whose_input_raises_ends_alone(harness):
    harness.submit("good")
    harness.scheduler.process_input_requests(
        [TokenizedGenerateReqInput(rid="bad", input_ids=[1, 2], sampling_params=None)]
    )  # handle_generate_request raises
    finishes = harness.run_until_idle()
    assert_error_finish(finishes["bad"], "handling its input", "AttributeError")
    assert finishes["good"] == GOOD
    harness.assert_memory_idle()


def test_scheduler_request_whose_finish_check_raises_ends_alone(harness):
    harness.submit("good")
    harness.submit("bad", stop=[123])  # the stop-string check calls 123.encode
    harness.submit("bad-stream", stream=True, stop=[123], input_ids=[5, 6, 7, 8, 9])
    finishes = harness.run_until_idle()
    assert_error_finish(finishes["bad"], "processing its output", "AttributeError")
    assert_error_finish(finishes["bad-stream"], "processing its output", "AttributeError")
    assert finishes["good"] == GOOD
    assert harness.released == {"good": 1, "bad": 1, "bad-stream": 1}
    harness.assert_memory_idle()
    harness.submit("after")  # still serving
    assert harness.run_until_idle() == {"after": GOOD}


def test_scheduler_request_whose_output_record_raises_ends_alone(harness):
    harness.submit("good", stream=True)
    harness.submit("bad", stream=True, stop=None)  # DetokenizeParams: list(None)
    finishes = harness.run_until_idle()
    assert_error_finish(finishes["bad"], "building its output", "TypeError")
    assert finishes["good"] == GOOD
    assert harness.released == {"good": 1, "bad": 1}
    harness.assert_memory_idle()


def test_scheduler_failing_forward_is_fatal(harness):
    def broken_forward(batch):
        raise RuntimeError("forward failed")

    harness.scheduler.worker.forward_batch_generation = broken_forward
    harness.submit("x")
    with pytest.raises(RuntimeError, match="forward failed"):
        harness.scheduler.event_loop()


# ---- detokenizer ----------------------------------------------------------------------
def detok_params() -> DetokenizeParams:
    return DetokenizeParams(
        skip_special_tokens=True, spaces_between_special_tokens=True, stop=[], no_stop_trim=False, stream=True
    )


def token_output(rows: list[tuple[str, list[int], dict | None, DetokenizeParams | None]]) -> BatchTokenIDOutput:
    return BatchTokenIDOutput(
        [
            ReqOutput(
                rid=rid,
                new_token_ids=ids,
                finished_reason=finished,
                prompt_tokens=2,
                completion_tokens=len(ids),
                detokenize_params=params,
            )
            for rid, ids, finished, params in rows
        ]
    )


def test_detokenizer_request_whose_step_raises_ends_alone(tiny_llama_dir, port_args):
    manager = DetokenizerManager(ServerArgs(model_path=str(tiny_llama_dir)), port_args)
    try:
        _check_detokenizer_wall(manager)
    finally:
        manager.recv_from_scheduler.context.destroy(linger=0)


def _check_detokenizer_wall(manager: DetokenizerManager) -> None:
    huge = 2**40  # decode() raises OverflowError
    out = manager.handle_batch_token_id_out(
        token_output([("good", [5, 6], None, detok_params()), ("bad", [5, huge], None, detok_params())])
    )
    assert [o.rid for o in out.outputs] == ["good", "bad"] and out.outputs[1].text_delta == ""
    assert out.outputs[0].finished_reason is None
    assert_error_finish(out.outputs[1].finished_reason, "detokenizing its output", "OverflowError")
    assert set(manager.states) == {"good"}
    # The scheduler's later outputs of "bad" (until its abort arrives) pass with no text;
    # an abort keeps its own reason.
    late = manager.handle_batch_token_id_out(
        token_output([("bad", [7], None, None), ("good", [huge], {"type": "abort", "message": "aborted"}, None)])
    )
    assert [o.text_delta for o in late.outputs] == ["", ""]
    assert [o.finished_reason for o in late.outputs] == [None, {"type": "abort", "message": "aborted"}]
    assert manager.states == {}


# ---- tokenizer manager ------------------------------------------------------------------
def str_output(rid: str, text: str, ids: list[int], finished: dict | None, logprobs=None) -> BatchStrOutput:
    return BatchStrOutput(
        [
            ReqOutput(
                rid=rid,
                new_token_ids=ids,
                finished_reason=finished,
                prompt_tokens=3,
                completion_tokens=len(ids),
                text_delta=text,
                output_token_logprobs=logprobs,
            )
        ]
    )


async def _generate(tm: TokenizerManager, **kwargs):
    return await tm.generate_request(GenerateReqInput(text="hello world", **kwargs))


def run_with_manager(model_dir, port_args, body) -> None:
    """Run `await body(tm, scheduler_in)` against an in-process TokenizerManager whose
    requests arrive on the PULL socket `scheduler_in`; close both afterwards."""
    scheduler_in = pull(port_args.tokenizer_to_scheduler)
    info = {
        "context_length": 2048,
        "vocab_size": 512,
        "max_total_num_tokens": 4096,
        "max_running_requests": 8,
        "eos_token_ids": [],
    }

    async def run() -> None:
        tm = TokenizerManager(ServerArgs(model_path=str(model_dir)), port_args, info)
        try:
            await body(tm, scheduler_in)
        finally:
            await tm.close()
            tm.send_to_scheduler.context.destroy(linger=0)

    asyncio.run(run())
    scheduler_in.close()


def test_tokenizer_manager_routes_by_internal_id_and_fails_one_request(tiny_llama_dir, port_args):
    async def body(tm: TokenizerManager, scheduler_in: zmq.Socket) -> None:
        [good] = await _generate(tm, rid="x")
        [bad] = await _generate(tm, rid="y", return_logprob=True)
        with pytest.raises(ValueError, match="^Duplicate request ID detected: x$"):
            await _generate(tm, rid="x")
        sent = drain(scheduler_in)
        good_id, bad_id = [m.rid for m in sent]
        assert good_id != bad_id and {good_id, bad_id}.isdisjoint({"x", "y"})
        tm._handle_batch_output(str_output(bad_id, "a", [5], None, logprobs=[(0.1,)]))  # (logprob, id) expected
        tm._handle_batch_output(str_output(good_id, "ok", [5, 6], {"type": "length", "length": 2}))
        [bad_out] = [o async for o in bad]
        assert_error_finish(bad_out["meta_info"]["finish_reason"], "handling its output", "ValueError")
        assert bad_out["meta_info"]["id"] == "y"
        [abort] = drain(scheduler_in)
        assert abort == AbortReq(rid=bad_id)  # the scheduler is told to stop it
        [good_out] = [o async for o in good]
        assert good_out["text"] == "ok" and good_out["meta_info"]["id"] == "x"

        # The label is free again; a late output of the old request never reaches the new one.
        [again] = await _generate(tm, rid="x")
        [msg] = drain(scheduler_in)
        assert msg.rid not in (good_id, bad_id)
        tm._handle_batch_output(str_output(good_id, "late", [9], {"type": "abort", "message": "aborted"}))
        tm._handle_batch_output(str_output(msg.rid, "new", [7], {"type": "length", "length": 1}))
        [again_out] = [o async for o in again]
        assert again_out["text"] == "new" and again_out["meta_info"]["finish_reason"]["type"] == "length"

        # A detokenizer failure: the tokenizer manager tells the scheduler to stop the request.
        [failing] = await _generate(tm, rid="z")
        [msg] = drain(scheduler_in)
        tm._handle_batch_output(str_output(msg.rid, "", [], {"type": "abort", "status_code": 500, "message": "m"}))
        [out] = [o async for o in failing]
        assert out["meta_info"]["finish_reason"]["status_code"] == 500
        assert drain(scheduler_in) == [AbortReq(rid=msg.rid)]
        assert tm.rid_to_state == {} and tm.label_to_rids == {}

    run_with_manager(tiny_llama_dir, port_args, body)


def test_tokenizer_manager_stream_keeps_outputs_that_arrive_while_a_chunk_is_out(tiny_llama_dir, port_args):
    """A streamed chunk is out with its consumer (e.g. the route awaiting admission) when the
    request's remaining outputs, its finish included, arrive: none of them is lost."""

    async def body(tm: TokenizerManager, scheduler_in: zmq.Socket) -> None:
        [stream] = await tm.generate_request(GenerateReqInput(text="hello world", stream=True), incremental=True)
        [msg] = drain(scheduler_in)
        tm._handle_batch_output(str_output(msg.rid, "a", [5], None))
        first = await anext(stream)
        tm._handle_batch_output(str_output(msg.rid, "b", [6], None))
        tm._handle_batch_output(str_output(msg.rid, "c", [7], {"type": "length", "length": 3}))
        rest = [chunk async for chunk in stream]
        assert first["text"] + "".join(c["text"] for c in rest) == "abc"
        assert rest[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}

    run_with_manager(tiny_llama_dir, port_args, body)
