"""Speculative decoding (`--speculative-algorithm NGRAM | STANDALONE`): drafts proposed
from the request's own tokens or by a small draft model, verified by the target model in
one forward (docs/architecture.md, "Speculative decoding")."""
