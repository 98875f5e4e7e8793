"""mla_rope"""
