"""SGLang's flags on a real server, in one start: --load-format dummy serves random
weights from a directory without weight files, working flags (--tp-size 1, ...) start,
and each no-effect flag leaves its one log line."""

from __future__ import annotations

import shutil

import httpx
from server_launcher import ServerHandle

from tandem.sglang_flags import COMPAT_FLAGS

NO_EFFECT_ARGS = [
    "--trust-remote-code",
    "--enable-cache-report",
    "--allow-auto-truncate",
    "--show-time-cost",
    "--revision",
    "main",
]
WORKING_ARGS = [
    "--tp-size",
    "1",
    "--dp-size",
    "1",
    "--tokenizer-worker-num",
    "1",
    "--page-size",
    "1",
    "--kv-cache-dtype",
    "auto",
    "--attention-backend",
    "torch_native",
    "--log-level-http",
    "warning",
    "--disable-overlap-schedule",
    "--log-requests",
    "--enable-metrics",
    "--disable-cuda-graph",
    "--cuda-graph-max-bs",
    "8",
    "--enable-torch-compile",
]


def test_dummy_weights_and_sglang_flags(tiny_llama_dir, tmp_path):
    model = tmp_path / "no-weights"
    shutil.copytree(tiny_llama_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    args = ["--load-format", "dummy", "--random-seed", "3", "--log-level", "info", *WORKING_ARGS, *NO_EFFECT_ARGS]
    with ServerHandle(model, args) as server:
        r = httpx.post(
            server.base_url + "/generate",
            timeout=60,
            json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        )
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
        assert httpx.get(server.base_url + "/model_info").json()["load_format"] == "dummy"
        info = httpx.get(server.base_url + "/server_info").json()
        assert info["tp_size"] == 1 and info["random_seed"] == 3 and info["disable_overlap_schedule"] is True
        log = server.log_path.read_text()
    flags = {f.names[0] for f in COMPAT_FLAGS if f.no_effect}
    for name in (a for a in NO_EFFECT_ARGS if a in flags):
        assert sum(f"{name} " in line and "has no effect here" in line for line in log.splitlines()) == 1, name
    assert "--disable-overlap-schedule" not in log  # a working flag: no line about it
