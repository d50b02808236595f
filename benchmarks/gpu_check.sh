#!/usr/bin/env bash
# `make gpu-check`: prove the CUDA path on a GPU machine in under 8 minutes, offline.
#
# The machine brings Python 3.12, torch with CUDA, triton and transformers, and has no
# network. The other dependencies travel as wheels: on a machine with network, run
# `make wheelhouse` first (benchmarks/wheelhouse.py: cp312 manylinux wheels of everything
# else, pinned, into ./wheelhouse; about 50 MiB) and bring the directory along
# (WHEELHOUSE=path to use another place). Then, on the GPU machine:
#     make gpu-check            (or: bash benchmarks/gpu_check.sh)
# Budget: tests 3 min, benchmark 4.5 min (results.md is rewritten after each model).
# Steps: install the wheels (--no-index --no-deps, so torch and triton stay), run the
# CUDA-marked tests and the Triton kernel tests (compiled, not interpreted), then the
# benchmark (benchmarks/gpu_check.py). Everything goes to $GPU_CHECK_OUT
# (default gpu_check_results/): pip.log, tests.txt, bench.txt, results.md, results.jsonl.
set -uo pipefail
export PIP_BREAK_SYSTEM_PACKAGES=1  # the machine's Python may be marked externally managed
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
OUT=${GPU_CHECK_OUT:-gpu_check_results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
status=0

"$PY" -c 'import torch, triton, transformers; assert torch.cuda.is_available(), "no CUDA device";
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__,
      torch.cuda.get_device_name())' | tee "$OUT/env.txt" || exit 2

if [ -f "$WHEELHOUSE/requirements.txt" ]; then
    "$PY" -m pip install --no-index --no-deps --find-links "$WHEELHOUSE" -r "$WHEELHOUSE/requirements.txt" \
        >"$OUT/pip.log" 2>&1 || { echo "wheel install failed: see $OUT/pip.log"; tail -5 "$OUT/pip.log"; exit 2; }
else
    echo "no $WHEELHOUSE/requirements.txt: run 'make wheelhouse' where there is network" >&2
fi

timeout 180 "$PY" -m pytest -q -p no:cacheprovider -o timeout=150 -rs \
    tests/cuda tests/unit/test_triton_attention.py tests/unit/test_attention_backends.py \
    tests/unit/test_cuda_graph_runner.py tests/unit/test_sampler.py \
    2>&1 | tee "$OUT/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 270 "$PY" benchmarks/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu-check: $([ $status -eq 0 ] && echo passed || echo FAILED); results in $OUT/"
exit $status
