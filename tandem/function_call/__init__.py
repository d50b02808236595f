"""Tool (function) calls in chat outputs: one detector per model family's call format
(`--tool-call-parser`), the JSON forms that constrained generation produces for
`tool_choice` required or a named function, and the JSON schema of that constraint."""
