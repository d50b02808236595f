"""Text report lines shared by `bench_serving` and `bench_offline_throughput` (SGLang's
layout: a 40-character label column, then the value), and the generated sections the
benchmark scripts write into markdown pages (docs/benchmarks.md): their markers, the
splice, and the machine / commit / load lines each section starts with."""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any


def report_row(name: str, value: Any, fmt: str = "") -> str:
    return f"{name:<40} {value:{fmt}}" if fmt else f"{name:<40} {value}"


def run_summary_rows(r: dict[str, Any], with_cached_tokens: bool) -> list[str]:
    """Request counts, duration, token totals and throughputs of one run's record."""
    rows = [
        report_row("Successful requests:", r["completed"]),
        report_row("Failed requests:", r["failed"]),
        report_row("Benchmark duration (s):", r["duration"], ".2f"),
        report_row("Total input tokens:", r["total_input_tokens"]),
        report_row("Total generated tokens:", r["total_output_tokens"]),
    ]
    if with_cached_tokens:
        rows.append(report_row("Total cached prompt tokens:", r["total_cached_tokens"]))
    return rows + [
        report_row("Request throughput (req/s):", r["request_throughput"], ".2f"),
        report_row("Input token throughput (tok/s):", r["input_throughput"], ".2f"),
        report_row("Output token throughput (tok/s):", r["output_throughput"], ".2f"),
        report_row("Total token throughput (tok/s):", r["total_throughput"], ".2f"),
    ]


# ---- generated sections of markdown pages (docs/benchmarks.md) ---------------------
# A benchmark script owns the text between its two markers and rewrites it alone:
#   <!-- BEGIN benchmarks/lora.py: generated, rerun it rather than editing this section -->
#   ...
#   <!-- END benchmarks/lora.py -->
GENERATED_NOTE = "generated, rerun it rather than editing this section"
_SECTION = re.compile(r"^<!-- BEGIN (?P<name>[^\n]+?): generated[^\n]*-->$.*?^<!-- END (?P=name) -->$", re.M | re.S)


def section_markers(script: str) -> tuple[str, str]:
    """The BEGIN and END comment lines of `script`'s generated section."""
    return f"<!-- BEGIN {script}: {GENERATED_NOTE} -->", f"<!-- END {script} -->"


def generated_sections(text: str) -> list[str]:
    """Every generated section of `text` (markers included), in page order."""
    return [m.group(0) for m in _SECTION.finditer(text)]


def splice_section(doc: Path, script: str, section: str, before: str | None = None) -> str:
    """Write `section` as `script`'s generated section of `doc`: replace the one there, else
    insert it before the first line starting with `before` (a heading), else append it.
    `section` may carry its markers or not (then they are added). Returns where it went."""
    begin, end = section_markers(script)
    section = section.strip("\n")
    if not section.startswith(begin):
        section = f"{begin}\n{section}\n{end}"
    text = doc.read_text() if doc.exists() else ""
    b = text.find(begin)
    e = text.find(end, b) if b >= 0 else -1
    if b >= 0 and e > b:
        text = text[:b] + section + text[e + len(end) :]
        where = "replaced its section"
    else:
        at = text.find("\n" + before) if before else -1
        if at >= 0:
            text = text[: at + 1] + section + "\n\n" + text[at + 1 :]
            where = f"inserted before its '{before}' section"
        elif text.strip():
            text = text.rstrip("\n") + "\n\n" + section + "\n"
            where = "appended"
        else:
            text = section + "\n"
            where = "appended"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return where


def rewrite_page(doc: Path, page: str) -> str:
    """Write `page` to `doc`, keeping (after it, in their order) every generated section that
    `doc` holds and `page` does not; return what it did."""
    old = doc.read_text() if doc.exists() else ""
    have = {m.group("name") for m in _SECTION.finditer(page)}
    kept = [m for m in _SECTION.finditer(old) if m.group("name") not in have]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(page.rstrip("\n") + "\n" + "".join(f"\n{m.group(0)}\n" for m in kept))
    if not kept:
        return "rewritten"
    return "rewritten, its generated sections kept: " + ", ".join(m.group("name") for m in kept)


# ---- what a generated section says about its run -----------------------------------
CPU_FEATURES = (
    ("AVX2", "avx2"),
    ("AVX-512F", "avx512f"),
    ("AVX-512 VNNI", "avx512_vnni"),
    ("AVX-512 BF16", "avx512_bf16"),
    ("AVX-VNNI", "avx_vnni"),
    ("AMX", "amx_tile"),
)


def cpu_features() -> str:
    """The SIMD extensions the kernels choose from, as /proc/cpuinfo lists them ("" elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return ""
    flags = set(line.partition(":")[2].split())
    if not flags:
        return ""
    amx = [f for f in ("amx_tile", "amx_int8", "amx_bf16", "amx_fp16") if f in flags]
    return (
        "SIMD (/proc/cpuinfo flags): "
        + ", ".join(f"{name} {'yes' if flag in flags else 'no'}" for name, flag in CPU_FEATURES)
        + (f" ({', '.join(amx)})" if amx else "")
    )


def machine_info() -> list[str]:
    """CPU model and cores, SIMD flags, RAM, OS and Python: one markdown list item each."""
    import psutil

    lines = []
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        info = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        model = info.get("Model name", "?").strip()
        hyper = info.get("Hypervisor vendor", "").strip()
        lines.append(
            f"CPU: {model}, {os.cpu_count()} cores (`nproc`), "
            f"{info.get('Thread(s) per core', '?').strip()} thread(s) per core"
            + (f", virtualized ({hyper})" if hyper else "")
        )
    except (OSError, subprocess.TimeoutExpired):
        lines.append(f"CPU: {os.cpu_count()} cores")
    features = cpu_features()
    if features:
        lines.append(features)
    lines.append(
        f"RAM: {psutil.virtual_memory().total / 2**30:.0f} GiB; no GPU; {platform.system()} "
        f"{platform.release()}; Python {platform.python_version()}"
    )
    return lines


def git_rev(repo: Path, ignore: tuple[Path, ...] = ()) -> str:
    """`git rev-parse --short HEAD`, with "+dirty" when tracked files other than `ignore`
    (say, the page a run writes) differ from it."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        root = repo.resolve()
        excludes = [
            f":(exclude){Path(p).resolve().relative_to(root)}" for p in ignore if Path(p).resolve().is_relative_to(root)
        ]
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *excludes],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return (rev or "unknown") + ("+dirty" if dirty else "")
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return "unknown"


def command_line(script: str, argv: list[str]) -> str:
    """The command that ran `script` with `argv`, as the page shows it."""
    return " ".join([".venv/bin/python", script, *(shlex.quote(a) for a in argv)])


def render_section(
    script: str,
    heading: str,
    command: str,
    started: float,
    loads: tuple[float, float],
    body: list[str],
    commit: str,
) -> str:
    """A generated section: its markers, `heading`, when (`started`, epoch seconds, to now,
    UTC) and at which commit it ran, the command, the machine, the 1-minute load average at
    the start and the end of the run, then `body` (tables and the reading)."""
    begin, end = section_markers(script)
    stamp = time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)) + time.strftime("-%H:%M UTC", time.gmtime())
    cores = os.cpu_count() or 1
    out = [begin, f"## {heading}", "", f"Measured {stamp} by `{script}`; Tandem at commit {commit}.", ""]
    out += ["```bash", command, "```", "", "Machine:", ""]
    out += [f"- {line}" for line in machine_info()]
    out += [
        f"- 1-minute load average: {loads[0]:.2f} at the start of the run, {loads[1]:.2f} at its end "
        f"(the run's own threads count in it, up to about the {cores} cores; above that, other processes "
        "competed for them)",
        "",
    ]
    out += [*body, "", end]
    return "\n".join(out) + "\n"
