"""Masked grouped-query attention (a prefill on a static cache)."""
