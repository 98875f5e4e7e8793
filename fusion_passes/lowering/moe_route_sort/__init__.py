"""A MoE layer's routing and its dispatch prep in one launch at decode."""
