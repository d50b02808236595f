"""Download, on a machine with network, the wheels `make gpu-check` installs on a GPU
machine without one: `make wheelhouse` (= `.venv/bin/python benchmarks/wheelhouse.py`).

The GPU machine brings Python 3.12, torch with CUDA and triton (the wheels here must not
replace them), and transformers. Everything else Tandem and its CUDA tests import is
taken from this venv: the packages of requirements.txt (less the test-only ones the
check does not run) and everything they depend on, at the versions installed here, as
cp312 manylinux x86_64 wheels, into `wheelhouse/` (ignored by git), with a pinned
`wheelhouse/requirements.txt` that gpu_check.sh installs with --no-index --no-deps.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# Brought by the GPU machine (CUDA builds), or only used by tests the check does not run.
SKIP = {"torch", "triton", "openai", "hypothesis", "schemathesis"}
SKIP_PREFIXES = ("nvidia-", "cuda-")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(path: Path) -> list[str]:
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.append(canonical(re.split(r"[<>=!~\[; ]", line)[0]))
    return names


def skipped(name: str) -> bool:
    return name in SKIP or name.startswith(SKIP_PREFIXES)


def closure(roots: list[str], python_version: str) -> dict[str, str]:
    """{name: installed version} of `roots` and their dependencies (no extras; markers
    evaluated for the GPU machine's Python)."""
    env = {"python_version": python_version, "python_full_version": python_version + ".0", "extra": ""}
    pinned: dict[str, str] = {}
    todo = [r for r in roots if not skipped(r)]
    while todo:
        name = todo.pop()
        if name in pinned:
            continue
        dist = metadata.distribution(name)
        pinned[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = canonical(req.name)
            if not skipped(dep) and dep not in pinned:
                todo.append(dep)
    return pinned


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "wheelhouse"))
    p.add_argument("--python-version", default="3.12")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    roots = requirement_names(ROOT / "requirements.txt") + ["pytest", "pytest-timeout"]
    pins = sorted(f"{name}=={version}" for name, version in closure(roots, args.python_version).items())
    (out / "requirements.txt").write_text("\n".join(pins) + "\n")
    abi = "cp" + args.python_version.replace(".", "")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        args.python_version,
        "--implementation",
        "cp",
        "--abi",
        abi,
        "--abi",
        "abi3",
        "--abi",
        "none",
        *[a for plat in PLATFORMS for a in ("--platform", plat)],
        "-d",
        str(out),
        "-r",
        str(out / "requirements.txt"),
    ]
    subprocess.run(cmd, check=True)
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(f"{len(pins)} packages, {size / 2**20:.1f} MiB of wheels in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
