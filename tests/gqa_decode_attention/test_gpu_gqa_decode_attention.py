"""CUDA: the GQA decode-attention rewrite at the built-in models' attention shapes (bf16) within
bf16's tolerance of transformers' repeat_kv + SDPA, with no copy kernel left; and tiny decode
steps (StaticCache, fullgraph) with every default fusion: each attention layer rewritten, fewer
kernels than stock Inductor, outputs over several steps within stock Inductor's own error against
eager, and a CUDA-graph replay. Skipped without a GPU (run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _gpu_decode import assert_graph_replay_matches, compile_step

import fusion_passes
from fusion_passes.kernels import count_kernels, profile_kernels
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import compare, tolerance
from fusion_passes.patterns.gqa_decode_attention import repeat_kv

pytestmark = pytest.mark.gpu
STEPS = 4


def transformers_sdpa(query, key, value, mask, scale):
    n_rep = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), attn_mask=mask,
                                          scale=scale)  # fmt: skip


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(48, 8, 128), (64, 4, 128), (16, 2, 256), (12, 3, 64)])
@pytest.mark.parametrize(("batch", "length"), [(1, 1028), (5, 77), (64, 300)])
def test_region_matches_repeat_kv_sdpa_without_copies(heads, kv_heads, head_dim, batch, length):
    g = torch.Generator(device="cuda").manual_seed(batch * length + heads)
    q = torch.randn(batch, heads, 1, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, length, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(batch, kv_heads, length, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    mask = torch.rand(batch, 1, 1, length, device="cuda", generator=g) > 0.2
    mask[..., 0] = True
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        fn = torch.compile(transformers_sdpa, backend=fusion_passes.backend(["gqa_decode_attention"], report=report),
                           fullgraph=True)  # fmt: skip
        out = fn(q, k, v, mask, head_dim**-0.5)
        kernels = [name for name, _ in profile_kernels(fn, q, k, v, mask, head_dim**-0.5)]
    assert report.final()["gqa_decode_attention"] == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.clone.default"], after["aten.clone.default"]) == (2, 0)
    expected = transformers_sdpa(q.double(), k.double(), v.double(), mask, head_dim**-0.5)
    stock = transformers_sdpa(q, k, v, mask, head_dim**-0.5)
    assert compare(out, expected).rel_norm <= max(2 * compare(stock, expected).rel_norm,
                                                  tolerance(torch.bfloat16).rel_norm)  # fmt: skip
    # no Inductor kernel as wide as the repeated keys: what is left is the mask's and the attention's
    assert not [n for n in kernels if "clone" in n], kernels


@pytest.mark.parametrize("model", ["qwen3-moe", "minimax-m2", "qwen3.5-moe"])
def test_decode_step_reads_the_cache_without_copies(model):
    torch._dynamo.reset()
    built = build_model(model, size="tiny", dtype=torch.bfloat16, layers=2, device="cuda")
    step = DecodeStep(built.module, batch=3, context=8, steps=STEPS)
    attention_layers = sum(1 for n, m in built.module.named_modules() if n.endswith("self_attn"))
    report = fusion_passes.Report()
    ours, codes = compile_step(step, fusion_passes.backend(report=report))
    stock, stock_codes = compile_step(step, "inductor")
    assert report.final()["gqa_decode_attention"] == attention_layers
    before, after = report.ops_before(), report.ops_after()
    assert before["aten.clone.default"] - after["aten.clone.default"] >= 2 * attention_layers
    assert sum(count_kernels(codes).values()) < sum(count_kernels(stock_codes).values())

    def error(fn, expected):
        step.restore()
        with torch.no_grad():
            outs = [fn(*step.inputs(i)).clone() for i in range(STEPS)]
        return max(compare(a, e).rel_norm for a, e in zip(outs, expected, strict=True))

    step.restore()
    with torch.no_grad():
        expected = [step(*step.inputs(i)).clone() for i in range(STEPS)]
    assert error(ours, expected) <= 2 * max(error(stock, expected), 4e-3)
    assert_graph_replay_matches(step, ours)
