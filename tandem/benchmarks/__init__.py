"""Helpers of the benchmark tools: workload generation (`datasets`), metric math (`metrics`)
and report text with the generated sections of docs/benchmarks.md (`report`). No server:
unit tests import them directly."""
