"""LoRA adapters: loading (adapter.py), the slot pool (pool.py), the per-forward
segmented matmuls (batch.py) and one rank's adapters and slots (manager.py)."""
