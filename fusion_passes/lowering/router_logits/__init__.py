"""A MoE router's logits in fp32 from bf16 / fp16 hidden states and gate weight, without upcast copies."""
