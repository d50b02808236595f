"""Two "nodes" on loopback: two launches with --nnodes 2 --tp-size 2 (node-rank 0 and 1)
meeting at --dist-init-addr 127.0.0.1:PORT. Node 0 serves HTTP with scheduler_TP0 and the
detokenizer, node 1 runs only scheduler_TP1; greedy outputs equal --tp-size 1's (the
session server); SIGKILL of node 1's process takes node 0 down within seconds, with a
log line naming the lost node, and leaves no process on either side."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest
from http_helpers import generate
from server_launcher import ServerHandle

from tandem.utils.process import free_port, pid_alive

PROMPTS = ["Hello", "Once upon a time, in a land far away, there lived", "1 2 3 4 5"]
PARAMS = {"max_new_tokens": 16, "temperature": 0}
DOWN_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def nodes(tiny_llama_dir):
    common = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    with ServerHandle(tiny_llama_dir, extra_args=[*common, "--node-rank", "1"], wait_ready=False) as node1:
        with ServerHandle(tiny_llama_dir, extra_args=[*common, "--node-rank", "0"]) as node0:
            node1.pids |= node1.child_pids()  # its ranks are up once node 0 is
            yield node0, node1


def _tandem_children(pid: int) -> set[str]:
    return {
        p.cmdline()[0] for p in psutil.Process(pid).children(recursive=True) if p.cmdline()[0].startswith("tandem::")
    }


def test_each_node_runs_its_share(nodes):
    node0, node1 = nodes
    assert _tandem_children(node0.proc.pid) == {"tandem::scheduler_TP0", "tandem::detokenizer"}
    assert _tandem_children(node1.proc.pid) == {"tandem::scheduler_TP1"}
    with pytest.raises(httpx.ConnectError):  # node 1 serves no HTTP
        httpx.get(node1.base_url + "/health", timeout=2)


def test_greedy_outputs_equal_tp1(client, nodes):
    node0, _ = nodes
    with httpx.Client(base_url=node0.base_url, timeout=120) as c:
        for prompt in PROMPTS:
            want = generate(client, text=prompt, sampling_params=PARAMS)
            got = generate(c, text=prompt, sampling_params=PARAMS)
            assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"], prompt


def test_killing_node_1_takes_node_0_down(nodes):
    node0, node1 = nodes
    node0.pids |= node0.child_pids()
    tic = time.monotonic()
    os.kill(node1.proc.pid, signal.SIGKILL)
    assert node0.proc.wait(timeout=DOWN_WITHIN_S) == 1, "node 0 kept running after node 1 died"
    assert time.monotonic() - tic < DOWN_WITHIN_S
    assert node0.stop(check=False) == [] and node1.stop(check=False) == []
    assert not any(pid_alive(pid) for pid in node0.pids | node1.pids)
    assert "another rank (node 1: TP1) died" in node0.log_tail(50), node0.log_tail(50)
