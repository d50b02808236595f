"""Runs a kernel check script of tests/ for a build of the C++ kernels for another CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_variant(script: str, march: str) -> list[str]:
    """`python tests/SCRIPT MARCH`: the script builds the kernel with `-march=MARCH` and checks
    it in a subprocess (the build's ops have this process's names); the words it printed, once
    it exits 0."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / script), march],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()
