"""MoE routing: scores, top-k experts and their renormalised weights per token, in one kernel."""
