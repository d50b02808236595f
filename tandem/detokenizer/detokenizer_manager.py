"""The detokenizer process: token ids in, text deltas out, one message per scheduler step.

Keeps one `IncrementalDetokenizer` per running request (by internal id), created from the
`DetokenizeParams` that the scheduler sends with a request's first output and dropped
when it finishes. An output for an id it does not know that carries no params (a late
output of a request that ended here) passes through with no text.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import traceback

import zmq

from tandem import finish_reason
from tandem.detokenizer.incremental_detokenizer import IncrementalDetokenizer, byte_fallback_token_ids
from tandem.messages import (
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizeParams,
    ReadyMessage,
)
from tandem.server_args import PortArgs, ServerArgs
from tandem.tokenizer.multi_tokenizer import OutputSender
from tandem.utils import zmq_io
from tandem.utils.cpu_threads import front_end_cpu, keep_threads_to
from tandem.utils.process import (
    configure_logging,
    ignore_stop_signals,
    notify_parent_of_failure,
    set_parent_death_signal,
    set_process_title,
)
from tandem.utils.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class DetokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs):
        self.tokenizer = load_tokenizer(server_args.tokenizer_path)
        self.byte_token_ids = byte_fallback_token_ids(self.tokenizer)
        self.states: dict[str, IncrementalDetokenizer] = {}
        ctx = zmq.Context(2)
        self.recv_from_scheduler = zmq_io.make_socket(ctx, zmq.PULL, port_args.scheduler_to_detokenizer, bind=True)
        # Under --tokenizer-worker-num N > 1, each worker gets its own requests' outputs alone.
        self.send_to_tokenizer = OutputSender(
            ctx, port_args, port_args.detokenizer_to_tokenizer, server_args.tokenizer_worker_num
        )

    def event_loop(self) -> None:
        while True:
            msg = zmq_io.loads(self.recv_from_scheduler.recv())
            if isinstance(msg, BatchTokenIDOutput):
                self.send_to_tokenizer.send(self.handle_batch_token_id_out(msg))
            else:
                logger.error("detokenizer got an unknown message %r", type(msg))

    def handle_batch_token_id_out(self, msg: BatchTokenIDOutput) -> BatchStrOutput:
        """Text deltas for every request of one scheduler step. A request whose step raises
        ends alone with an error finish (docs/architecture.md, "Failure handling"); the others are unaffected."""
        out = BatchStrOutput()
        for record in msg.outputs:
            finished = record.finished_reason
            try:
                text = self._step(record.rid, record.new_token_ids, finished, record.detokenize_params)
            except Exception as e:  # noqa: BLE001 - the second wall
                logger.error("request %s failed while detokenizing:\n%s", record.rid, traceback.format_exc())
                self.states.pop(record.rid, None)
                text = ""
                if finished is None or finished["type"] != "abort":  # an abort already says why
                    finished = finish_reason.internal_error("detokenizing its output", e)
            out.outputs.append(
                dataclasses.replace(record, text_delta=text, finished_reason=finished, detokenize_params=None)
            )
        return out

    def _step(self, rid: str, new_ids: list[int], finished: dict | None, params: DetokenizeParams | None) -> str:
        state = self.states.get(rid)
        if state is None:
            if params is None:  # a late output of a request that ended here: the tokenizer manager drops it
                return ""
            state = self.states[rid] = IncrementalDetokenizer(self.tokenizer, params, self.byte_token_ids)
        text = state.step(new_ids, finished)
        if finished is not None:
            del self.states[rid]
        return text


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs) -> None:
    """Entry of the detokenizer subprocess; it runs until the parent ends it (SIGKILL)."""
    set_parent_death_signal()
    set_process_title("tandem::detokenizer")
    configure_logging(server_args.log_level, "detokenizer")
    ignore_stop_signals()  # the parent drains, then ends us
    ready = zmq_io.make_socket(zmq.Context.instance(), zmq.PUSH, port_args.ready, bind=False)
    try:
        manager = DetokenizerManager(server_args, port_args)
    except Exception as e:
        logger.error("detokenizer failed to start:\n%s", traceback.format_exc())
        zmq_io.send(ready, ReadyMessage(process="detokenizer", ok=False, error=f"{type(e).__name__}: {e}"))
        sys.exit(1)
    front = front_end_cpu(server_args.device, server_args.local_scheduler_ranks)
    if front is not None:  # tandem/utils/cpu_threads.py, "Placement"
        keep_threads_to(front)
    zmq_io.send(ready, ReadyMessage(process="detokenizer"))
    try:
        manager.event_loop()
    except Exception:
        logger.error("detokenizer crashed:\n%s", traceback.format_exc())
        notify_parent_of_failure()
        sys.exit(1)
