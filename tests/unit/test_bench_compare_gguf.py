"""benchmarks/compare.py --gguf without servers: its arguments, the section it renders from
saved rows (ratios Tandem / llama.cpp, the #23 targets, the output-length check) and how it
rewrites that section of a markdown file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("bench_compare", REPO / "benchmarks" / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_compare"] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("bench_compare", None)


def _args(compare, tmp_path, *extra):
    args = compare.parse_args(
        ["--gguf", "--gguf-source", str(tmp_path / "m.Q4_1.gguf"), "--gguf-dequant", "q4_1", "--threads", "2", *extra]
    )
    args.command = ".venv/bin/python benchmarks/compare.py --gguf"
    return args


def _run_row(label, engine, workload, tok_s, ttft, *, repeat=0, wrong=0):
    return {
        "model": label,
        "format": label,
        "engine": engine,
        "workload": workload,
        "repeat": repeat,
        "status": "ok",
        "output_throughput": tok_s,
        "median_ttft_ms": ttft,
        "median_tpot_ms": 1000 / tok_s,
        "completed": 4,
        "failed": 0,
        "wrong_length": wrong,
        "timestamp": 1_800_000_000.0 + repeat,
        "loadavg_1m": 0.5,
        "version": "this checkout (abc1234)",
    }


def _rows(compare):
    files = [
        {
            "kind": "gguf-file",
            "label": "Q4_1",
            "path": "/m/m.Q4_1.gguf",
            "made_by": "source",
            "size_mib": 93.8,
            "types": {"Q4_1": 210, "F32": 61},
            "eos_ids": [2],
            "timestamp": 1_800_000_000.0,
        },
        {
            "kind": "gguf-file",
            "label": "Q8_0",
            "path": "/m/gguf-bench/m.Q8_0.gguf",
            "size_mib": 138.1,
            "made_by": "llama-quantize --allow-requantize m.Q4_1.gguf m.Q8_0.gguf Q8_0",
            "types": {"Q8_0": 211},
            "eos_ids": [2],
            "timestamp": 1_800_000_000.0,
        },
    ]
    rows = list(files)
    # Q4_1: Tandem meets every target; Q8_0: one stream too slow, one request of another length.
    for w, t, c in (("b", 150.0, 100.0), ("a", 500.0, 200.0), ("e", 1200.0, 300.0)):
        rows += [
            _run_row("Q4_1", "tandem", w, t, 50),
            _run_row("Q4_1", compare.LLAMACPP, w, c, 60),
            _run_row("Q4_1", compare.DEQUANT, w, t * 0.8, 70),
        ]
    for w, t, c in (("b", 90.0, 100.0), ("a", 500.0, 200.0), ("e", 1200.0, 300.0)):
        rows += [
            _run_row("Q8_0", "tandem", w, t, 50, wrong=1 if w == "a" else 0),
            _run_row("Q8_0", compare.LLAMACPP, w, c, 40),
        ]
    rows += [
        {
            "kind": compare.LLAMA_BENCH,
            "engine": compare.LLAMA_BENCH,
            "format": label,
            "model": label,
            "workload": None,
            "status": "ok",
            "pp_tok_s": 374.0,
            "pp_stddev": 3.0,
            "tg_tok_s": 133.0,
            "tg_stddev": 1.5,
            "version": "llama-server 0.5.0-dev",
        }
        for label in ("Q4_1", "Q8_0")
    ]
    return rows


def _plan(compare, args):
    return compare.Plan(
        models=["Q4_1", "Q8_0"],
        engines=list(compare.GGUF_ENGINES),
        workloads=["a", "b", "e"],
        repeats=3,
        radix_extra=False,
    )


def test_gguf_arguments(compare, tmp_path):
    args = _args(compare, tmp_path)
    assert args.engines == list(compare.GGUF_ENGINES)
    assert sorted(args.workloads) == ["a", "b", "e"]
    assert args.gguf_formats == ["q4_1", "q4_0", "q8_0", "q4_k_m", "bf16"]
    assert args.gguf_dequant == ["Q4_1"]
    assert args.out.name == "gguf.md" and args.results_jsonl.name == "gguf-results.jsonl"
    with pytest.raises(SystemExit):
        _args(compare, tmp_path, "--engines", "tandem,vllm")
    with pytest.raises(SystemExit):
        _args(compare, tmp_path, "--gguf-formats", "q3_xs")
    cmd = compare.llama_server_command(Path("f.gguf"), 8000, args)
    assert cmd[1:] == [
        "-m",
        "f.gguf",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "-a",
        "m",
        "-t",
        "2",
        "-tb",
        "2",
        "-np",
        "64",
        "-c",
        "65536",
    ]
    server, _ = compare.server_command(compare.DEQUANT, Path("f.gguf"), 8000, "auto", args)
    assert "--dtype" not in server and server[-2:] == ["--linear-backend", "torch"]


def test_gguf_section(compare, tmp_path):
    args = _args(compare, tmp_path)
    text = compare.render_gguf(_rows(compare), args, _plan(compare, args))
    assert text.startswith(compare.GGUF_DOC_BEGIN) and text.rstrip().endswith(compare.GGUF_DOC_END)
    assert "SMOKE RUN" not in text and "commit abc1234" in text
    ratios = next(line for line in text.splitlines() if line.startswith("| Q4_1 | 150.0 / 100.0"))
    assert "**1.50x**" in ratios and "**2.50x**" in ratios and "| 1.25x |" in ratios and ratios.endswith("| met |")
    q8 = next(line for line in text.splitlines() if line.startswith("| Q8_0 | 90.0 / 100.0"))
    assert q8.endswith("| not met: 1 stream < 1.2x, TTFT (1 request(s) failed or of another length: not comparable) |")
    # Tandem's best bf16 row is the dequantized Q4_1 one: 0.8x of Tandem's Q4_1 figures.
    assert "(a) 400 tok/s (Q4_1 file, --linear-backend torch)" in text
    assert "| Q8_0 | Tandem | " in text and "| 12 / 0 / 1 |" in text  # 3 workloads x 4 requests, 1 of another length
    assert "| Q4_1 | 374 ± 3 | 133.0 ± 1.5 |" in text
    assert "requantized" in text
    args.quick = True
    assert "SMOKE RUN" in compare.render_gguf(_rows(compare), args, _plan(compare, args))


def test_splice_doc(compare, tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nintro\n\n## GGUF: hand-written\n\nnotes\n")
    first = f"{compare.GGUF_DOC_BEGIN}\n## generated one\n{compare.GGUF_DOC_END}\n"
    assert "inserted" in compare.splice_doc(doc, first)
    second = f"{compare.GGUF_DOC_BEGIN}\n## generated two\n{compare.GGUF_DOC_END}\n"
    assert "replaced" in compare.splice_doc(doc, second)
    text = doc.read_text()
    assert text.count(compare.GGUF_DOC_BEGIN) == 1 and "generated one" not in text
    assert text.index("generated two") < text.index("## GGUF: hand-written")
    assert text.startswith("# Benchmarks\n\nintro\n") and text.endswith("notes\n")
    other = tmp_path / "other.md"
    other.write_text("# Other\n")
    assert compare.splice_doc(other, first) == "appended" and other.read_text().endswith(compare.GGUF_DOC_END + "\n")


def test_write_main_doc(compare, tmp_path):
    """A main run rewrites the page and keeps the GGUF section a --gguf run wrote there; a GGUF
    run then replaces that section alone."""
    doc = tmp_path / "benchmarks.md"
    assert compare.write_main_doc(doc, "# Benchmarks\n\nrun one\n") == "rewritten"
    gguf = f"{compare.GGUF_DOC_BEGIN}\n## GGUF run\n{compare.GGUF_DOC_END}\n"
    assert compare.splice_doc(doc, gguf) == "appended"
    assert "kept" in compare.write_main_doc(doc, "# Benchmarks\n\nrun two\n")
    text = doc.read_text()
    assert "run one" not in text and text.startswith("# Benchmarks\n\nrun two\n")
    assert text.count(compare.GGUF_DOC_BEGIN) == 1 and text.rstrip().endswith(compare.GGUF_DOC_END)
    assert "replaced" in compare.splice_doc(doc, gguf.replace("GGUF run", "GGUF run two"))
    assert "run two\n" in doc.read_text() and "## GGUF run two" in doc.read_text()


def test_main_page_header(compare):
    """The page says it is generated whole and points at the perf log; no notes, no Reading."""
    args = compare.parse_args(["--engines", "tandem", "--models", "7m", "--dtypes", "float32", "--workloads", "b"])
    args.command = ".venv/bin/python benchmarks/compare.py"
    assert args.doc is None and not args.no_doc
    plan = compare.Plan(models=["7m fp32"], engines=["tandem"], workloads=["b"], repeats=3, radix_extra=False)
    page = compare.render_markdown([], args, plan, {}, None)
    assert compare.PAGE_INTRO in page and "perf-log/" in page and "SMOKE RUN" not in page
    assert "## Reading" not in page and "../shared" not in page
