"""The offline `Engine`: Tandem without HTTP, for scripts and RL rollout frameworks.

`Engine(model_path=..., **server_args)` starts the scheduler and detokenizer
subprocesses, with the TokenizerManager in the caller's process. The manager runs on a
private event loop in a background thread, so the sync API works anywhere (also where the
caller already runs an event loop) and `async_generate` works from any loop.

    from tandem import Engine
    with Engine(model_path="models/demo-llama") as engine:
        print(engine.generate("Hello", {"max_new_tokens": 8, "temperature": 0})["text"])

Scripts that create an Engine must guard their entry point with
`if __name__ == "__main__":` (subprocesses are spawned, as with multiprocessing).
Every subprocess ends at `shutdown()`, on leaving the `with` block, or at interpreter exit.
If one of them dies (killed, out of memory), every call waiting on the engine and every
later one raises `EngineDeadError` naming it, instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from tandem.entrypoints.native_protocol import GenerateReqInput
from tandem.entrypoints.streams import last_outputs, merge_streams
from tandem.entrypoints.subprocesses import ServerProcesses, launch_subprocesses
from tandem.messages import (
    GetWeightsByNameReqInput,
    HostTensor,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsReq,
)
from tandem.model_executor.model_loader import check_model
from tandem.server_args import ServerArgs
from tandem.tokenizer.tokenizer_manager import TokenizerManager
from tandem.utils.process import configure_logging

Output = dict[str, Any] | list[dict[str, Any]]


class EngineDeadError(RuntimeError):
    """A subprocess of the engine exited: shut it down and start a new one."""


class Engine:
    def __init__(self, model_path: str | None = None, *, server_args: ServerArgs | None = None, **kwargs: Any):
        if server_args is None:
            if model_path is None:
                raise ValueError("model_path: required")
            kwargs.setdefault("log_level", "warning")
            server_args = ServerArgs(model_path=model_path, **kwargs)
        server_args.validate()
        check_model(server_args)
        if server_args.node_rank > 0:
            raise ValueError("node_rank: the offline Engine runs on node 0 (start other nodes with launch_server)")
        if server_args.tokenizer_worker_num > 1:
            raise ValueError("tokenizer_worker_num: the offline Engine has one tokenizer manager (only 1)")
        self.server_args = server_args
        configure_logging(server_args.log_level, "engine")
        self._dead: str | None = None  # why the engine can no longer serve
        self._pending: set[Future] = set()
        self._procs: ServerProcesses | None = launch_subprocesses(server_args)
        self._procs.watch(self._on_child_death)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-engine-loop", daemon=True)
        self._thread.start()
        try:
            self.tokenizer_manager = self._call(self._make_manager())
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)

    async def _make_manager(self) -> TokenizerManager:
        # Created on the engine loop: its asyncio sockets belong to that loop.
        return TokenizerManager(self.server_args, self._procs.port_args, self._procs.scheduler_info)

    def _on_child_death(self, name: str) -> None:
        self._dead = f"the engine's subprocess {name} exited; shut this engine down and start a new one"
        for future in list(self._pending):
            future.cancel()  # cancels its task on the engine loop; the waiter raises EngineDeadError

    def _call(self, coro) -> Any:
        try:
            return self._submit(coro).result()
        except concurrent.futures.CancelledError:
            if self._dead:
                raise EngineDeadError(self._dead) from None
            raise

    async def _await(self, coro) -> Any:
        """`coro` run on the engine loop, awaited from the caller's loop."""
        try:
            return await asyncio.wrap_future(self._submit(coro))
        except asyncio.CancelledError:
            if self._dead:
                raise EngineDeadError(self._dead) from None
            raise

    def _submit(self, coro) -> Future:
        if self._dead:
            coro.close()
            raise EngineDeadError(self._dead)
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    # ---- public API ----------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        custom_logit_processor: str | list[str | None] | None = None,
        lora_path: str | list[str | None] | None = None,
    ) -> Output | Iterator[dict[str, Any]]:
        """Like POST /generate: a dict (or a list for a batch or n > 1), or with `stream=True`
        an iterator of chunks (with several outputs, each chunk carries its output's "index":
        prompt_index * n + sample_index). `lora_path`: the LoRA adapter's name (one per prompt in a batch)."""
        obj = self._request(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
            stream,
            rid,
            token_ids_logprob,
            custom_logit_processor,
            lora_path,
        )
        if stream:
            return self._sync_stream(obj)
        return self._call(self._collect(obj))

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        custom_logit_processor: str | list[str | None] | None = None,
        lora_path: str | list[str | None] | None = None,
    ) -> Output | AsyncIterator[dict[str, Any]]:
        """The asyncio twin of `generate`, usable from any event loop."""
        obj = self._request(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
            stream,
            rid,
            token_ids_logprob,
            custom_logit_processor,
            lora_path,
        )
        if stream:
            return self._async_stream(obj)
        return await self._await(self._collect(obj))

    def get_server_info(self) -> dict[str, Any]:
        """What GET /server_info returns: arguments, capacities, live memory counts."""
        return self._call(self.tokenizer_manager.server_info())

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
    ) -> tuple[bool, str]:
        """Load new weights of the same architecture from `model_path` (SGLang's
        Engine.update_weights_from_disk); returns (success, message)."""
        return self._update_weights(
            UpdateWeightFromDiskReqInput(
                request_id="",
                model_path=model_path,
                load_format=load_format,
                abort_all_requests=abort_all_requests,
                weight_version=weight_version,
            )
        )

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
    ) -> tuple[bool, str]:
        """Replace the named checkpoint tensors (whole tensors, checkpoint names, e.g.
        `model.layers.0.mlp.up_proj.weight`) without a restart (SGLang's
        Engine.update_weights_from_tensor); the other weights keep their values. The
        tensors travel to the scheduler as byte arrays (`HostTensor`, through host
        memory and the control pipe), which
        pauses admission, rebuilds the model with them on every TP rank (each takes its
        shard) and swaps it in only if every rank succeeded; `flush_cache=False` keeps
        the prefix cache (for a series of partial updates). Send a whole model in one
        call: each call rebuilds every layer. Returns (success, message)."""
        tensors = [(name, HostTensor.of(tensor)) for name, tensor in named_tensors]
        return self._update_weights(
            UpdateWeightsFromTensorReqInput(
                request_id="",
                named_tensors=tensors,
                load_format=load_format,
                flush_cache=flush_cache,
                abort_all_requests=abort_all_requests,
                weight_version=weight_version,
            )
        )

    def _update_weights(self, req: UpdateWeightsReq) -> tuple[bool, str]:
        out = self._call(self.tokenizer_manager.update_weights(req))
        return out.success, out.message

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of the served checkpoint tensor `name`;
        ValueError when there is none."""
        out = self._call(
            self.tokenizer_manager.get_weights_by_name(
                GetWeightsByNameReqInput(request_id="", name=name, truncate_size=truncate_size)
            )
        )
        if out.parameter is None:
            raise ValueError(out.message)
        return out.parameter

    def pids(self) -> list[int]:
        """Pids of the engine's subprocesses (for checks that none outlives it)."""
        return self._procs.pids() if self._procs else []

    def shutdown(self) -> None:
        """End every subprocess and the engine loop; safe to call more than once."""
        procs, self._procs = self._procs, None
        if procs is not None:
            procs.shutdown()
        manager = getattr(self, "tokenizer_manager", None)
        if manager is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(manager.close(), self._loop).result()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        atexit.unregister(self.shutdown)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- internals -----------------------------------------------------------------
    @staticmethod
    def _request(
        prompt,
        sampling_params,
        input_ids,
        return_logprob,
        logprob_start_len,
        top_logprobs_num,
        return_text_in_logprobs,
        stream,
        rid,
        token_ids_logprob,
        custom_logit_processor=None,
        lora_path=None,
    ) -> GenerateReqInput:
        obj = GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            stream=stream,
            rid=rid,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            token_ids_logprob=token_ids_logprob,
            custom_logit_processor=custom_logit_processor,
            lora_path=lora_path,
        )
        obj.validate_shape()
        return obj

    async def _collect(self, obj: GenerateReqInput) -> Output:
        outputs = await last_outputs(await self.tokenizer_manager.generate_request(obj))
        return outputs if obj.is_batch or len(outputs) > 1 else outputs[0]

    async def _open_merged(self, obj: GenerateReqInput) -> AsyncIterator[dict[str, Any]]:
        streams = await self.tokenizer_manager.generate_request(obj)
        multi = len(streams) > 1 or obj.is_batch

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            async for index, chunk in merge_streams(streams):
                yield {**chunk, "index": index} if multi else chunk

        return chunks()

    def _sync_stream(self, obj: GenerateReqInput) -> Iterator[dict[str, Any]]:
        agen = self._call(self._open_merged(obj))
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if self._loop.is_running() and not self._dead:
                self._call(agen.aclose())

    async def _async_stream(self, obj: GenerateReqInput) -> AsyncIterator[dict[str, Any]]:
        agen = await self._await(self._open_merged(obj))
        try:
            while True:
                try:
                    yield await self._await(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if self._loop.is_running() and not self._dead:
                await self._await(agen.aclose())
