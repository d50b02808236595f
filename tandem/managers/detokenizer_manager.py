"""The detokenizer process: token ids in, text deltas out, one message per scheduler step.

Keeps one `IncrementalDetokenizer` per running rid, created from the `DetokenizeParams`
that the scheduler sends with a request's first output and dropped when it finishes.
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback

import zmq

from tandem.managers.incremental_detokenizer import IncrementalDetokenizer, byte_fallback_token_ids
from tandem.managers.io_struct import BatchStrOutput, BatchTokenIDOutput, ReadyMessage
from tandem.server_args import PortArgs, ServerArgs
from tandem.utils import zmq_io
from tandem.utils.process import configure_logging, notify_parent_of_failure, set_parent_death_signal
from tandem.utils.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class DetokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs):
        self.tokenizer = load_tokenizer(server_args.tokenizer_path)
        self.byte_token_ids = byte_fallback_token_ids(self.tokenizer)
        self.states: dict[str, IncrementalDetokenizer] = {}
        ctx = zmq.Context(2)
        self.recv_from_scheduler = zmq_io.make_socket(ctx, zmq.PULL, port_args.scheduler_to_detokenizer, bind=True)
        self.send_to_tokenizer = zmq_io.make_socket(ctx, zmq.PUSH, port_args.detokenizer_to_tokenizer, bind=False)

    def event_loop(self) -> None:
        while True:
            msg = zmq_io.loads(self.recv_from_scheduler.recv())
            if isinstance(msg, BatchTokenIDOutput):
                zmq_io.send(self.send_to_tokenizer, self.handle_batch_token_id_out(msg))
            else:
                logger.error("detokenizer got an unknown message %r", type(msg))

    def handle_batch_token_id_out(self, msg: BatchTokenIDOutput) -> BatchStrOutput:
        out = BatchStrOutput(rids=msg.rids, new_token_ids=msg.new_token_ids,
                             finished_reasons=msg.finished_reasons, **msg.meta())
        for i, rid in enumerate(msg.rids):
            state = self.states.get(rid)
            if state is None:
                params = msg.detokenize_params[i]
                assert params is not None, f"first output of {rid} came without DetokenizeParams"
                state = self.states[rid] = IncrementalDetokenizer(self.tokenizer, params, self.byte_token_ids)
            finished = msg.finished_reasons[i]
            out.text_deltas.append(state.step(msg.new_token_ids[i], finished))
            if finished is not None:
                del self.states[rid]
        return out


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs) -> None:
    """Entry of the detokenizer subprocess."""
    set_parent_death_signal()
    configure_logging(server_args.log_level, "detokenizer")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ready = zmq_io.make_socket(zmq.Context.instance(), zmq.PUSH, port_args.ready, bind=False)
    try:
        manager = DetokenizerManager(server_args, port_args)
    except Exception as e:
        logger.error("detokenizer failed to start:\n%s", traceback.format_exc())
        zmq_io.send(ready, ReadyMessage(process="detokenizer", ok=False, error=f"{type(e).__name__}: {e}"))
        sys.exit(1)
    zmq_io.send(ready, ReadyMessage(process="detokenizer"))
    try:
        manager.event_loop()
    except Exception:
        logger.error("detokenizer crashed:\n%s", traceback.format_exc())
        notify_parent_of_failure()
        sys.exit(1)
