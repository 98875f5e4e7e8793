"""A prefill's depthwise causal conv (+ SiLU): canonical op, reference and Triton kernel."""
