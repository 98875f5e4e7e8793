"""rms_norm"""
