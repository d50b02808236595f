"""Weights kept quantized for the CPU kernels: GGUF blocks repacked into Tandem's own layouts."""
