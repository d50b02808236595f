"""Constrained decoding (structured output) on xgrammar: a request's `json_schema`,
`regex` or `ebnf` restricts every token it samples to those that keep its output inside
the grammar. See docs/architecture.md, "Constrained decoding"."""
