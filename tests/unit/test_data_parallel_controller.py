"""The data-parallel controller's parts in-process: load balancing by each method, the
one merged reply per control call, and its routing over real ipc sockets with fake
replicas (PULL sockets)."""

from __future__ import annotations

import zmq

from tandem.data_parallel.controller import DataParallelController, LoadBalancer, ReplyCombiner
from tandem.messages import (
    AbortReq,
    DpFinishedReqs,
    DpReplicaReply,
    FlushCacheOutput,
    FlushCacheReq,
    ServerStateOutput,
    TokenizedGenerateReqInput,
)
from tandem.sampling.sampling_params import SamplingParams
from tandem.server_args import PortArgs, ServerArgs
from tandem.utils import zmq_io


def _state(request_id: str, running: int, free: int, idle: float, version: str = "default") -> ServerStateOutput:
    return ServerStateOutput(
        request_id,
        max_total_num_tokens=100,
        free_kv_slots=free,
        evictable_cached_slots=0,
        protected_cached_slots=0,
        num_running_reqs=running,
        num_waiting_reqs=0,
        free_req_rows=4,
        forward_idle_fraction=idle,
        weight_version=version,
        num_finished_reqs=running,
    )


def test_round_robin_takes_replicas_in_turn():
    lb = LoadBalancer("round_robin", 3)
    assert [lb.pick() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_follows_requests_in_flight():
    lb = LoadBalancer("shortest_queue", 2)
    picks = []
    for i in range(4):
        k = lb.pick()
        lb.dispatched(k, f"r{i}")
        picks.append(k)
    assert picks == [0, 1, 0, 1]
    lb.finished(1, ["r1", "r3"])
    assert lb.pick() == 1  # replica 1 has none in flight, replica 0 two
    lb.finished(0, ["r0", "r2", "unknown"])  # a finish of a request it does not hold changes nothing
    assert [len(s) for s in lb.in_flight] == [0, 0] and lb.pick() == 0


def test_combiner_answers_once_every_replica_replied():
    c = ReplyCombiner(2)
    assert c.add(1, _state("q", running=2, free=90, idle=0.5, version="v1")) is None
    merged = c.add(0, _state("q", running=1, free=80, idle=0.1, version="v0"))
    assert merged.num_running_reqs == 3 and merged.free_kv_slots == 170 and merged.max_total_num_tokens == 200
    assert abs(merged.forward_idle_fraction - 0.3) < 1e-9 and merged.weight_version == "v0"
    assert [s.num_running_reqs for s in merged.dp_rank_states] == [1, 2]  # DP-rank order
    assert c.pending == {}
    c.add(0, FlushCacheOutput("f", True))
    failed = c.add(1, FlushCacheOutput("f", False, "requests are running"))
    assert failed.success is False and failed.message == "requests are running"


def test_controller_routes_requests_aborts_and_control_calls(tmp_path):
    port_args = PortArgs(ipc_dir=str(tmp_path))
    args = ServerArgs(model_path="/m", dp_size=2, load_balance_method="round_robin", device="cpu")
    ctx = zmq.Context()
    replicas = [zmq_io.make_socket(ctx, zmq.PULL, port_args.dp_scheduler_input(k), bind=True) for k in range(2)]
    tokenizer = zmq_io.make_socket(ctx, zmq.PULL, port_args.scheduler_to_tokenizer, bind=True)
    controller = DataParallelController(args, port_args)
    try:
        for i in range(3):
            controller.handle_tokenizer_message(TokenizedGenerateReqInput(f"r{i}", [1, 2], SamplingParams()))
        controller.handle_tokenizer_message(AbortReq(rid="r1"))
        controller.handle_tokenizer_message(FlushCacheReq("f"))
        got = [[zmq_io.loads(r.recv()) for _ in range(n)] for r, n in zip(replicas, (4, 3))]
        assert [m.rid for m in got[0][:2]] == ["r0", "r2"] and got[1][0].rid == "r1"
        assert all(isinstance(g[-2], AbortReq) and isinstance(g[-1], FlushCacheReq) for g in got)
        assert controller.balancer.in_flight == [{"r0", "r2"}, {"r1"}]
        controller.handle_replica_message(DpFinishedReqs(1, ["r1"]))
        controller.handle_replica_message(DpReplicaReply(0, FlushCacheOutput("f", True)))
        assert tokenizer.poll(100) == 0  # not before replica 1 replied
        controller.handle_replica_message(DpReplicaReply(1, FlushCacheOutput("f", True)))
        assert zmq_io.loads(tokenizer.recv()) == FlushCacheOutput("f", True)
        assert controller.balancer.in_flight == [{"r0", "r2"}, set()]
    finally:
        controller._ctx.destroy(linger=0)
        ctx.destroy(linger=0)
