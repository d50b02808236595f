"""The detokenizer subprocess: token ids from the scheduler in, text deltas to the tokenizer
side out."""
