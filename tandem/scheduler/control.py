"""The scheduler's control calls: server state, cache flush, weight reads and updates,
profiling, LoRA adapters (SGLang's /server_info, /flush_cache, /update_weights_from_*,
/get_weights_by_name, /start_profile and /stop_profile, /load_lora_adapter and
/unload_lora_adapter: tandem/lora/control.py, as they reach one scheduler).

A weight update pauses admission (optionally aborting every request first) and runs, and is
answered, once no request runs (`update_weights_when_idle`, called by the loop every
iteration): every TP rank loads or none does, the prefix cache is flushed (its KV came from
the old weights), the weight version is set, admission resumes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tandem.lora.control import LoraControl
from tandem.messages import (
    AbortReq,
    ControlOutput,
    ControlReq,
    FlushCacheOutput,
    FlushCacheReq,
    GetServerStateReq,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    LoadLoRAAdapterReqInput,
    ProfileReq,
    ServerStateOutput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsReq,
)

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler


class SchedulerControl:
    """Answers the control calls that reach `scheduler`, and holds the weight update state."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        # A weight update waiting for the running requests to finish; admission is paused meanwhile.
        self.pending_weight_update: UpdateWeightsReq | None = None
        self.weight_version = "default"
        self.num_weight_updates = 0
        self.lora = LoraControl(scheduler)
        # Message type -> handler returning the reply (None: it replies later).
        self.handlers: dict[type, Callable[[Any], ControlOutput | None]] = {
            GetServerStateReq: lambda msg: self.server_state(msg.request_id),
            FlushCacheReq: lambda msg: self.flush_cache(msg.request_id),
            ProfileReq: scheduler.profiler.handle,
            UpdateWeightFromDiskReqInput: self.handle_update_weights,
            UpdateWeightsFromTensorReqInput: self.handle_update_weights,
            GetWeightsByNameReqInput: self.get_weights_by_name,
            LoadLoRAAdapterReqInput: self.lora.load,
            UnloadLoRAAdapterReqInput: self.lora.unload,
        }

    def handles(self, msg) -> bool:
        return isinstance(msg, ControlReq) and type(msg) in self.handlers

    def handle(self, msg: ControlReq) -> None:
        reply = self.handlers[type(msg)](msg)
        if reply is not None:
            self.scheduler.io.send_reply(reply)

    def admission_paused(self) -> bool:
        return self.pending_weight_update is not None

    def server_state(self, request_id: str) -> ServerStateOutput:
        s = self.scheduler
        return ServerStateOutput(
            request_id=request_id,
            max_total_num_tokens=s.max_total_num_tokens,
            free_kv_slots=s.kv.token_to_kv_pool.available_size(),
            evictable_cached_slots=s.tree_cache.evictable_size(),
            protected_cached_slots=s.tree_cache.protected_size(),
            num_running_reqs=len(s.active_reqs()),
            num_waiting_reqs=len(s.batches.waiting_queue) + len(s.grammar_queue),
            free_req_rows=s.kv.req_to_token_pool.available_size(),
            forward_idle_fraction=s.executor.stats.idle_fraction(),
            weight_version=self.weight_version,
            num_finished_reqs=s.num_finished_reqs,
            gen_throughput=round(s.gen_throughput.rate(), 2),
            **({} if s.spec is None else s.spec.totals()),
        )

    def flush_cache(self, request_id: str) -> FlushCacheOutput:
        s = self.scheduler
        if s.active_reqs() or s.batches.waiting_queue:
            return FlushCacheOutput(request_id, False, "cannot flush the cache while requests are running or waiting")
        s.sync_inflight()  # an extra step of a finished request may still write its KV
        s.tree_cache.reset()
        return FlushCacheOutput(request_id, True)

    def get_weights_by_name(self, msg: GetWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
        try:
            values = self.scheduler.worker.model_runner.get_weights_by_name(msg.name, msg.truncate_size)
        except ValueError as e:
            return GetWeightsByNameReqOutput(msg.request_id, None, str(e))
        return GetWeightsByNameReqOutput(msg.request_id, values)

    def handle_update_weights(self, msg: UpdateWeightsReq) -> UpdateWeightFromDiskReqOutput | None:
        """Pause admission (optionally aborting every request); the update runs, and is
        answered, once nothing runs."""
        if self.pending_weight_update is not None:
            return UpdateWeightFromDiskReqOutput(
                msg.request_id, False, "another weight update is in progress", weight_version=self.weight_version
            )
        if msg.abort_all_requests:
            self.scheduler.handle_abort(AbortReq(abort_all=True, message="aborted for a weight update"))
        self.pending_weight_update = msg
        return None

    def update_weights_when_idle(self) -> None:
        """Run the pending weight update once no request runs."""
        s, msg = self.scheduler, self.pending_weight_update
        if msg is None or s.active_reqs():
            return
        s.sync_inflight()  # an extra step of a finished request may still write its KV
        runner = s.worker.model_runner
        if isinstance(msg, UpdateWeightsFromTensorReqInput):
            success, message = runner.update_weights_from_tensor(
                [(name, t.to_tensor()) for name, t in msg.named_tensors], msg.load_format
            )
        else:
            success, message = runner.update_weights_from_disk(msg.model_path, msg.load_format)
        if success and msg.flush_cache:
            s.tree_cache.reset()
        if success:
            self.num_weight_updates += 1
            self.weight_version = msg.weight_version or str(self.num_weight_updates)
        self.pending_weight_update = None
        s.io.send_reply(
            UpdateWeightFromDiskReqOutput(
                msg.request_id,
                success,
                message,
                num_paused_requests=len(s.batches.waiting_queue),
                weight_version=self.weight_version,
            )
        )
