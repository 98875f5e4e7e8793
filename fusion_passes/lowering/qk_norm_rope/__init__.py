"""qk_norm_rope"""
