"""Model math in plain PyTorch: per-row RoPE, KV snapshots, assemble/extract, masks, forwards."""
