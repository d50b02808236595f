"""Tandem's C++ CPU kernels (csrc/*_cpu.cpp, sharing csrc/vec.h and csrc/ops.h): built once per machine,
loaded on demand.

`load()` returns the loaded ops (`torch.ops.tandem_cpu`) or None when they cannot be had
(no C++ compiler, a build error, `TANDEM_DISABLE_CPU_KERNELS=1`); callers then use their
PyTorch fallback, so a machine without a compiler still serves, only slower. The library
is compiled with the system's C++ compiler (`$CXX`, else `c++`) against the installed
PyTorch, with `-O3 -march=native` (the build is for this machine's CPU), into
`$TANDEM_KERNEL_CACHE` (default `~/.cache/tandem/kernels`) under a name that hashes the
sources, the flags, PyTorch's version and the CPU, so a change of any of them rebuilds.
`make install` builds it (`python -m tandem.kernels.cpu`); otherwise the first server
start on a machine does (about 35 seconds on 2 cores, the six sources compiled side by side).
Concurrent builds (tensor-parallel ranks starting together) each work in a temporary
directory and rename the library into place.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    CSRC / "decode_attention_cpu.cpp",
    CSRC / "extend_attention_cpu.cpp",
    CSRC / "elementwise_cpu.cpp",
    CSRC / "quant_linear_cpu.cpp",
    CSRC / "decode_layer_cpu.cpp",
    CSRC / "threads_cpu.cpp",
)
HEADERS = (CSRC / "vec.h", CSRC / "ops.h")
FLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=c++17", "-w")
NATIVE = "native"  # -march: the build is for this machine's CPU


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_KERNEL_CACHE", Path.home() / ".cache" / "tandem" / "kernels"))


def _cpu_signature() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compile_commands(
    cxx: str, sources: tuple[Path, ...], objects: list[Path], out: Path, march: str
) -> tuple[list[list[str]], list[str]]:
    """One command per source (run side by side) compiling it to its object, then the link."""
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch.compiled_with_cxx11_abi())
    compile_flags = [
        *FLAGS,
        *f"-march={march}".split(),
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *[f"-I{p}" for p in include_paths()],
    ]
    compiles = [[cxx, *compile_flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(sources, objects)]
    link = [
        cxx,
        "-shared",
        "-fopenmp",
        *map(str, objects),
        "-o",
        str(out),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        f"-Wl,-rpath,{torch_lib}",
    ]
    return compiles, link


def _run_all(commands: list[list[str]], cxx: str) -> None:
    """Runs the commands side by side; raises with the first failure's errors."""
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in commands]
    errors = [p.communicate()[1] for p in procs]
    for proc, err in zip(procs, errors):
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{err[-4000:]}")


def library_path(sources: tuple[Path, ...] = SOURCES, march: str = NATIVE) -> Path:
    key = hashlib.sha256()
    for src in sources + HEADERS:
        key.update(src.read_bytes())
    key.update(" ".join((*FLAGS, march)).encode() + torch.__version__.encode() + _cpu_signature().encode())
    return cache_dir() / f"tandem_cpu_{key.hexdigest()[:16]}.so"


def build(sources: tuple[Path, ...] = SOURCES, march: str = NATIVE) -> Path:
    """Compile the library unless this machine's build is cached; its path. Raises on failure.
    `sources` and `march` other than the defaults build a variant (tests of the kernels' paths
    for other CPUs: `-march=x86-64-v3` has AVX2 and no AVX-512, `x86-64` neither); flags after
    a space in `march` are passed too (`"x86-64-v3 -mavxvnni"`)."""
    path = library_path(sources, march)
    if path.exists():
        return path
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        objects = [Path(work) / f"{src.stem}.o" for src in sources]
        tmp = Path(work) / path.name
        compiles, link = _compile_commands(cxx, sources, objects, tmp, march)
        _run_all(compiles, cxx)
        _run_all([link], cxx)
        os.replace(tmp, path)  # atomic: a concurrent build's reader sees a whole file or none
    return path


@functools.cache
def load():
    """`torch.ops.tandem_cpu` with the kernels registered, or None (see the module docstring)."""
    if os.environ.get("TANDEM_DISABLE_CPU_KERNELS", "0") not in ("", "0"):
        return None
    try:
        torch.ops.load_library(str(build()))
    except Exception as exc:  # noqa: BLE001 - any failure means: use the PyTorch fallback
        logger.warning("Tandem's C++ CPU kernels are unavailable, using PyTorch fallbacks: %s", exc)
        return None
    return torch.ops.tandem_cpu


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def ops_for(*tensors: torch.Tensor):
    """`load()`'s kernels when they may take `tensors`: CPU tensors of one dtype among
    float32, bfloat16 and float16, none requiring grad where grad is on (the kernels have
    no backward); else None, and the caller runs its PyTorch code."""
    first = tensors[0]
    if not first.is_cpu or first.dtype not in _DTYPES or any(t.dtype != first.dtype for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return load()


if __name__ == "__main__":
    print(build())
    sys.exit(0 if load() is not None else 1)
