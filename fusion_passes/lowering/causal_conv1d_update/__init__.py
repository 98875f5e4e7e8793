"""causal_conv1d_update"""
