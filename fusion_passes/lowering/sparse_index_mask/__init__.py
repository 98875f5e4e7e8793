"""DeepSeek V3.2's sparse-attention index mask: the positions outside each row's top k, in one kernel."""
