"""Which waiting requests join the next prefill batch, and in what order.

`SchedulePolicy` orders the waiting queue: `fcfs` (arrival order) or `lpm` (longest
cached prefix first; falls back to fcfs for very long queues, where matching every
request each step would cost more than it saves).

`Scheduler.get_new_prefill_batch` admits requests one by one while their KV fits:
    budget = free slots + evictable cached slots
             - KV the running requests are expected to still need
An admitted request costs its prompt tokens not already cached plus its expected future
tokens. Expected future tokens = remaining max_new_tokens x `new_token_ratio`, a decaying
estimate (as SGLang's): it starts at `init`, shrinks by `decay` every decode step down to
`min`, and jumps back up after a retraction. Over-admission is repaired by retraction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.managers.schedule_batch import Req
from tandem.mem_cache.req_kv import ReqKVManager

LPM_MAX_QUEUE = 128


class SchedulePolicy:
    def __init__(self, policy: str, kv: ReqKVManager):
        if policy not in ("fcfs", "lpm"):
            raise ValueError(f"--schedule-policy: unknown policy {policy!r}")
        self.policy = policy
        self.kv = kv

    def order(self, waiting: list[Req]) -> list[Req]:
        if self.policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
            return waiting
        lens = {id(r): self.kv.tree_cache.match_prefix(r.seq_ids[: r.seq_len - 1]).slots.numel()
                for r in waiting}
        return sorted(waiting, key=lambda r: -lens[id(r)])  # stable: ties keep arrival order


@dataclass
class NewTokenRatio:
    """Fraction of a request's remaining max_new_tokens that admission reserves."""

    init: float = 0.7
    min: float = 0.1
    decay: float = 0.001
    value: float = field(init=False)

    def __post_init__(self) -> None:
        self.value = self.init

    def step(self) -> None:
        self.value = max(self.min, self.value - self.decay)

    def on_retract(self) -> None:
        self.value = min(1.0, max(self.value, self.init) + 0.1)


def expected_future_tokens(req: Req, ratio: float) -> int:
    remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
    return int(max(remaining, 0) * ratio)
