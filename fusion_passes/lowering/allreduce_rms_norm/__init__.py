"""allreduce_rms_norm"""
