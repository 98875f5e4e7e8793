"""MoE dispatch prep: tokens sorted by expert, with the grouped GEMM's offsets, in one kernel."""
