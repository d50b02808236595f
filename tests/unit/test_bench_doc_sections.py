"""tandem.benchmarks.report's generated sections of a markdown page: a script's section is
replaced or appended between its markers, the others left alone, and a whole-page rewrite
(benchmarks/compare.py's main run) keeps every generated section."""

from __future__ import annotations

from tandem.benchmarks import report


def _section(script: str, text: str) -> str:
    begin, end = report.section_markers(script)
    return f"{begin}\n## {text}\n{end}\n"


def test_markers():
    begin, end = report.section_markers("benchmarks/lora.py")
    assert begin == "<!-- BEGIN benchmarks/lora.py: generated, rerun it rather than editing this section -->"
    assert end == "<!-- END benchmarks/lora.py -->"


def test_splice_replaces_or_appends(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nintro\n")
    assert report.splice_section(doc, "benchmarks/lora.py", "## LoRA one\n") == "appended"  # markers added
    assert report.splice_section(doc, "benchmarks/compare.py --gguf", _section("benchmarks/compare.py --gguf", "G"))
    assert report.splice_section(doc, "benchmarks/lora.py", _section("benchmarks/lora.py", "LoRA two")) == (
        "replaced its section"
    )
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n\n<!-- BEGIN benchmarks/lora.py:")
    assert "LoRA one" not in text and text.count("## LoRA two") == 1 and text.index("LoRA two") < text.index("## G")
    assert [s.splitlines()[1] for s in report.generated_sections(text)] == ["## LoRA two", "## G"]
    # A script name that prefixes another's ("compare.py" and "compare.py --gguf") is its own section.
    assert report.splice_section(doc, "benchmarks/compare.py", "## main") == "appended"
    assert report.generated_sections(doc.read_text())[1] == _section("benchmarks/compare.py --gguf", "G").strip()


def test_splice_before_heading(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## GGUF: notes\n\nhand-written\n")
    where = report.splice_section(doc, "benchmarks/x.py", "## X", before="## GGUF")
    assert where == "inserted before its '## GGUF' section"
    text = doc.read_text()
    assert text.index("## X") < text.index("## GGUF: notes") and text.endswith("hand-written\n")


def test_rewrite_page_keeps_every_generated_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    assert report.rewrite_page(doc, "# Benchmarks\n\nrun one\n") == "rewritten"
    for script in ("benchmarks/compare.py --gguf", "benchmarks/moe_decode.py", "benchmarks/speculative.py"):
        report.splice_section(doc, script, f"## {script} section")
    where = report.rewrite_page(doc, "# Benchmarks\n\nrun two\n")
    assert where.startswith("rewritten, its generated sections kept") and "benchmarks/moe_decode.py" in where
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nrun two\n") and "run one" not in text
    names = [s.splitlines()[1] for s in report.generated_sections(text)]
    assert names == [
        f"## {s} section"
        for s in ("benchmarks/compare.py --gguf", "benchmarks/moe_decode.py", "benchmarks/speculative.py")
    ]
    assert report.rewrite_page(doc, "# Benchmarks\n\nrun three\n").count("benchmarks/") == 3
    assert doc.read_text().count("<!-- BEGIN") == 3


def test_render_section():
    text = report.render_section(
        "benchmarks/lora.py",
        "LoRA (#27)",
        ".venv/bin/python benchmarks/lora.py --repeats 2",
        0.0,
        (0.5, 1.25),
        ["| a | b |", "|---|---|"],
        "abc1234",
    )
    begin, end = report.section_markers("benchmarks/lora.py")
    lines = text.splitlines()
    assert lines[0] == begin and lines[1] == "## LoRA (#27)" and lines[-1] == end
    assert "Measured 1970-01-01 00:00-" in text and "commit abc1234" in text
    assert "```bash\n.venv/bin/python benchmarks/lora.py --repeats 2\n```" in text
    assert "- CPU: " in text and "0.50 at the start of the run, 1.25 at its end" in text
    assert (
        report.command_line("benchmarks/lora.py", ["--model", "a b"])
        == ".venv/bin/python benchmarks/lora.py --model 'a b'"
    )
