"""DeepSeek V3.2 indexer scores: canonical op, reference, Triton kernel."""
