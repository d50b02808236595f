"""The scheduler's LoRA control calls (SGLang's /load_lora_adapter and /unload_lora_adapter)
and the resolution of a request's adapter name to its load id.

Every TP rank gets the same calls in the same order (rank 0 broadcasts its input), so
every rank loads the same adapters under the same ids; only rank 0's reply is sent. A
load or unload first waits for the forward in flight (it reads the adapters). An unload
is refused while a queued or running request uses the adapter (409, naming them): nothing
already accepted is lost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.messages import LoadLoRAAdapterReqInput, LoRAUpdateOutput, UnloadLoRAAdapterReqInput

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler


class LoraControl:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.manager = getattr(scheduler.worker.model_runner, "lora", None)  # None without --enable-lora

    def uid_of(self, name: str) -> int | None:
        """The load id of adapter `name`, or None when it is not loaded."""
        return None if self.manager is None else self.manager.uids.get(name)

    def _reply(self, request_id: str, error: str = "", in_use: list[str] | None = None) -> LoRAUpdateOutput:
        loaded = {} if self.manager is None else self.manager.loaded()
        return LoRAUpdateOutput(request_id, not error, error, loaded, in_use or [])

    def load(self, msg: LoadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        if self.manager is None:
            return self._reply(msg.request_id, "LoRA is not enabled on this server (--enable-lora)")
        self.scheduler.sync_inflight()
        try:
            self.manager.load(msg.lora_name, msg.lora_path)
        except (ValueError, OSError) as e:
            return self._reply(msg.request_id, str(e))
        return self._reply(msg.request_id)

    def unload(self, msg: UnloadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        if self.manager is None:
            return self._reply(msg.request_id, "LoRA is not enabled on this server (--enable-lora)")
        uid = self.uid_of(msg.lora_name)
        if uid is None:
            return self._reply(msg.request_id, f"LoRA adapter {msg.lora_name!r} is not loaded")
        s = self.scheduler
        queued = s.active_reqs() + s.batches.waiting_queue + s.grammar_queue.reqs()
        users = [r.rid for r in queued if r.lora_uid == uid]
        if users:
            return self._reply(
                msg.request_id, f"LoRA adapter {msg.lora_name!r} is in use by {len(users)} request(s)", users
            )
        s.sync_inflight()
        self.manager.unload(msg.lora_name)
        return self._reply(msg.request_id)
