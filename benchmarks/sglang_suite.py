"""Run SGLang's own server tests against Tandem (#9, #26), or against SGLang itself, and
print the two side by side. Not part of CI: it needs SGLang's package (for
`sglang.test.test_utils`) and SGLang's test files.

    PYTHONPATH=SGL_PKG .venv/bin/python benchmarks/sglang_suite.py --model-path DIR \
        --tests-dir DIR [--results tandem.json] test_srt_endpoint test_matched_stop ...
    .../venv-sgl/bin/python benchmarks/sglang_suite.py --engine sglang --results sglang.json ...
    python benchmarks/sglang_suite.py --compare sglang.json tandem.json

SGLang's package without its server dependencies is enough for Tandem's runs:
`pip install --no-deps --target SGL_PKG sglang==0.5.23` and then, the same way, each module
`import sglang.test.test_utils` still misses (pybase64, pillow, msgspec, IPython, aiohttp,
datasets, pandas, torchvision patched by ../shared/peers/patch_torchvision_cpu.py, ...); the
full peer environment (`bash ../shared/peers/setup.sh sglang`) is needed to run SGLang's
server (`--engine sglang`).

`--tests-dir` holds test modules copied from SGLang's repository (test/registered/...,
test/srt/...); they are SGLang's code (Apache-2.0) and are not shipped here. Each module is
run with unittest, as SGLang runs them, after two substitutions:
- every `DEFAULT_*MODEL*` name in `sglang.test.test_utils` becomes `--model-path` (a
  local model directory; no hub access), as does any other model name given to
  `popen_launch_server` or `get_tokenizer` that is not a directory, and
- (`--engine tandem`) `popen_launch_server` launches Tandem: the `sglang serve ...` command
  it builds runs `python -m tandem.launch_server ...` with the same flags (a `sglang` script
  first on PATH), in Tandem's environment (`--tandem-python`, without PYTHONPATH);
  (`--engine sglang`) it runs SGLang's own `sglang serve` from the running Python's venv on the
  CPU (SGLANG_USE_CPU_ENGINE=1) with `--max-total-tokens` 65536 unless the test sets it, and
  `--tests-dir` on its PYTHONPATH (custom logit processors are loaded by module name).
Prints each test's result and, at the end, the pass count per module; `--results` keeps
each test's outcome (ok, fail, error, skip; a failing setUpClass fails its class's tests)
for `--compare`, which lists every test with both outcomes and the pass counts.
"""

from __future__ import annotations

import argparse
import json
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
    _put_sglang_first_on_path(
        bin_dir,
        f'for a do shift; case "$a" in {skip}) ;; *) set -- "$@" "$a" ;; esac; done\n'
        f'cd {REPO} && exec env -u PYTHONPATH {tandem_python} -m tandem.launch_server "$@"\n',
    )


def _put_sglang_first_on_path(bin_dir: Path, body: str) -> None:
    """Write `bin_dir/sglang`, a shell script that drops a leading `serve` and runs `body`, and
    put `bin_dir` first on PATH (popen_launch_server runs `sglang serve ...`)."""
    script = bin_dir / "sglang"
    script.write_text('#!/bin/sh\n[ "$1" = serve ] && shift\n' + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def _install_sglang_launcher(bin_dir: Path, max_total_tokens: int) -> None:
    """A `sglang` executable that runs this Python's SGLang on the CPU (SGLANG_USE_CPU_ENGINE=1, as
    ../shared/peers/serve.sh does) with a bounded KV cache (`--max-total-tokens`, before the test's
    own flags so that a test's value wins): left alone, SGLang takes 70% of RAM for it."""
    real = Path(sys.executable).parent / "sglang"
    _put_sglang_first_on_path(
        bin_dir, f'exec env SGLANG_USE_CPU_ENGINE=1 {real} serve --max-total-tokens {max_total_tokens} "$@"\n'
    )


def _point_models_at(model_path: str) -> None:
    import sglang.srt.utils.hf_transformers_utils as hf
    import sglang.test.test_utils as tu

    for name in dir(tu):
        if name.startswith("DEFAULT_") and "MODEL" in name and isinstance(getattr(tu, name), str):
            setattr(tu, name, model_path)

    # Some classes name a hub model outright (test_tool_choice's "Qwen/Qwen2.5-7B-Instruct"):
    # the server and the tokenizer get the local directory for any name that is not one.
    def local(fn):
        return lambda model, *a, **kw: fn(model if os.path.isdir(model) else model_path, *a, **kw)

    tu.popen_launch_server, hf.get_tokenizer = local(tu.popen_launch_server), local(hf.get_tokenizer)


def _outcomes(test_ids: list[str], result: unittest.TestResult) -> dict[str, str]:
    """Each test id -> ok / fail / error / skip; a class whose setUpClass failed fails its tests."""
    outcomes = dict.fromkeys(test_ids, "ok")
    for kind, pairs in (("fail", result.failures), ("error", result.errors), ("skip", result.skipped)):
        for test, _ in pairs:
            if isinstance(test, unittest.TestCase):
                outcomes[test.id()] = kind
            else:  # _ErrorHolder "setUpClass (module.Class)": every test of that class
                name = str(test).partition("(")[2].rstrip(")")
                for tid in outcomes:
                    if tid.startswith(name + "."):
                        outcomes[tid] = kind
    return outcomes


def _tests(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _tests(item)
        else:
            yield item


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    names = [Path(p).stem for p in (a_path, b_path)]
    print(f"| test | {names[0]} | {names[1]} |\n|---|---|---|")
    for tid in sorted(set(a) | set(b)):
        print(f"| {tid} | {a.get(tid, '-')} | {b.get(tid, '-')} |")
    print(f"| passed | {sum(v == 'ok' for v in a.values())} | {sum(v == 'ok' for v in b.values())} |")
    both = [t for t in a if a[t] == "ok" and b.get(t) != "ok"]
    print(f"\n{names[0]} passes and {names[1]} does not ({len(both)}): {', '.join(both) or 'none'}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", nargs=2, metavar="RESULTS", help="print two --results files side by side")
    ap.add_argument("--model-path")
    ap.add_argument("--tests-dir")
    ap.add_argument("--engine", choices=["tandem", "sglang"], default="tandem")
    ap.add_argument("--results", help="write each test's outcome here (JSON), for --compare")
    ap.add_argument("--tandem-python", default=str(REPO / ".venv" / "bin" / "python"))
    ap.add_argument(
        "--drop-flag",
        action="append",
        default=[],
        help="a value-less flag to leave out of every launch, as --drop-flag=--FLAG (diagnosis: run the tests "
        "of a class whose server needs a flag Tandem refuses)",
    )
    ap.add_argument(
        "--sglang-max-total-tokens",
        type=int,
        default=65536,
        help="(--engine sglang) the KV cache size SGLang's server gets unless a test sets it",
    )
    ap.add_argument("modules", nargs="*", help="test module names (or module.Class.test) in --tests-dir")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not (args.model_path and args.tests_dir and args.modules):
        ap.error("--model-path, --tests-dir and at least one module are required")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.engine == "tandem":
        _install_launcher(Path(tempfile.mkdtemp(prefix="tandem-sglang-suite-")), args.tandem_python, args.drop_flag)
    else:
        _install_sglang_launcher(Path(tempfile.mkdtemp(prefix="sglang-suite-")), args.sglang_max_total_tokens)
        # SGLang's server loads a custom logit processor's class by its module name (dill keeps
        # `test_srt_endpoint` for a class defined in that module): its CI runs the servers from the
        # test directory; here the directory is put on the servers' path.
        paths = [os.path.abspath(args.tests_dir), os.environ.get("PYTHONPATH")]
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    _point_models_at(os.path.abspath(args.model_path))
    sys.path.insert(0, os.path.abspath(args.tests_dir))

    summary, outcomes = [], {}
    for name in args.modules:
        suite = unittest.defaultTestLoader.loadTestsFromName(name)
        test_ids = [test.id() for test in _tests(suite)]  # the run empties the suite
        result = unittest.TextTestRunner(verbosity=2).run(suite)
        found = _outcomes(test_ids, result)
        outcomes.update(found)
        values = list(found.values())
        summary.append((name, values.count("ok"), len(values), values.count("skip")))
    if args.results:
        Path(args.results).write_text(json.dumps(outcomes, indent=1, sort_keys=True))
    print("\n| module | passed | run | skipped |\n|---|---|---|---|")
    for name, passed, run, skipped in summary:
        print(f"| {name} | {passed} | {run} | {skipped} |")
    total = [sum(col) for col in zip(*(row[1:] for row in summary))]
    print(f"| total | {total[0]} | {total[1]} | {total[2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
