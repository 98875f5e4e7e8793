"""gated_delta_step"""
