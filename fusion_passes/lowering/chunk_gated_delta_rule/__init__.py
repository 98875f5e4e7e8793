"""Gated DeltaNet's chunked prefill: the gated delta rule over a whole prompt."""
