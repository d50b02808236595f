"""Run SGLang's own server tests against Tandem (#9). Not part of CI: it needs the SGLang
peer environment (`bash ../shared/peers/setup.sh sglang`) and SGLang's test files.

    /tmp/peers/venv-sgl/bin/python benchmarks/sglang_suite.py --model-path DIR \\
        --tests-dir DIR [--drop-flag=--FLAG] test_srt_endpoint test_matched_stop ...

`--tests-dir` holds test modules copied from SGLang's repository (test/srt/...); they are
SGLang's code (Apache-2.0) and are not shipped here. Each module is run with unittest, as
SGLang runs them, after two substitutions:
- every `DEFAULT_*MODEL*` name in `sglang.test.test_utils` becomes `--model-path` (a
  local model directory; no hub access), and
- `popen_launch_server` launches Tandem: the `sglang serve ...` command it builds runs
  `python -m tandem.launch_server ...` with the same flags (a `sglang` script first on
  PATH), in Tandem's environment (`--tandem-python`).
Prints each test's result and, at the end, the pass count per module.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
import tempfile
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _install_launcher(bin_dir: Path, tandem_python: str, drop: list[str]) -> None:
    """A `sglang` executable that turns `sglang serve ARGS` into Tandem's launcher, without
    the value-less flags in `drop`."""
    skip = "|".join(drop) or "--never-given--"
    script = bin_dir / "sglang"
    script.write_text(
        "#!/bin/sh\n"
        '[ "$1" = serve ] && shift\n'
        f'for a do shift; case "$a" in {skip}) ;; *) set -- "$@" "$a" ;; esac; done\n'
        f'cd {REPO} && exec {tandem_python} -m tandem.launch_server "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def _point_models_at(model_path: str) -> None:
    import sglang.test.test_utils as tu

    for name in dir(tu):
        if name.startswith("DEFAULT_") and "MODEL" in name and isinstance(getattr(tu, name), str):
            setattr(tu, name, model_path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tests-dir", required=True)
    ap.add_argument("--tandem-python", default=str(REPO / ".venv" / "bin" / "python"))
    ap.add_argument(
        "--drop-flag",
        action="append",
        default=[],
        help="a value-less flag to leave out of every launch, as --drop-flag=--FLAG (diagnosis: run the tests "
        "of a class whose server needs a flag Tandem refuses)",
    )
    ap.add_argument("modules", nargs="+", help="test module names (or module.Class.test) in --tests-dir")
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _install_launcher(Path(tempfile.mkdtemp(prefix="tandem-sglang-suite-")), args.tandem_python, args.drop_flag)
    _point_models_at(os.path.abspath(args.model_path))
    sys.path.insert(0, os.path.abspath(args.tests_dir))

    summary = []
    for name in args.modules:
        suite = unittest.defaultTestLoader.loadTestsFromName(name)
        result = unittest.TextTestRunner(verbosity=2).run(suite)
        # A failing setUpClass is one error for the class: its tests count as not passed.
        bad = sum(isinstance(test, unittest.TestCase) for test, _ in result.failures + result.errors)
        passed = result.testsRun - bad - len(result.skipped)
        summary.append((name, passed, suite.countTestCases(), len(result.skipped)))
    print("\n| module | passed | run | skipped |\n|---|---|---|---|")
    for name, passed, run, skipped in summary:
        print(f"| {name} | {passed} | {run} | {skipped} |")
    total = [sum(col) for col in zip(*(row[1:] for row in summary))]
    print(f"| total | {total[0]} | {total[1]} | {total[2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
