"""Constrained decoding (structured output) on xgrammar, llguidance or outlines
(`--grammar-backend`): a request's `json_schema`, `regex` or `ebnf` restricts every
token it samples to those that keep its output inside the grammar. See docs/architecture.md, "Constrained decoding"."""
