"""Several bias-free linears of one input (a layer's small projections) as one GEMM launch."""
