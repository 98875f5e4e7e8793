"""masked_attention_causal's kernel (the masked attention kernel with the prompt's causal mask
compared in it, from the first cache position): bit-equal to the masked kernel on the additive
mask it stands for (0 / -65504, SDPA's cuDNN form, and 0 / -inf), and within the dtype's
tolerance of the plain-torch reference; a first prompt and one continuing a cache, cache lengths
past the prompt (the unwritten slots closed), odd lengths and head dims, GQA ratios, tiles smaller
than the prompt (several blocks before, on and after the diagonal); fp32 / bf16 / fp16; on CPU
tensors through Triton's interpreter, or on CUDA tensors, compiled, where a GPU is present."""

import os

import torch  # torch does not import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Chosen before triton is first imported; only without a GPU (see test_rms_norm_kernel.py).
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from _hypothesis import examples  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fusion_passes  # noqa: E402,F401  (registers torch.ops.fusion_passes)
from fusion_passes.lowering.masked_attention.reference import (  # noqa: E402
    causal_mask_from_first,
    masked_attention_causal_reference,
)
from fusion_passes.lowering.masked_attention.triton import masked_attention_triton  # noqa: E402
from fusion_passes.numerics import tolerance  # noqa: E402


@st.composite
def _cases(draw):
    s = draw(st.sampled_from([2, 5, 17, 40]))
    first = draw(st.sampled_from([0, 0, 3, 20]))
    heads, groups = draw(st.sampled_from([(2, 1), (4, 2), (6, 3)]))
    return dict(
        b=draw(st.sampled_from([1, 2])), heads=heads, kv_heads=heads // groups, s=s, first=first,
        length=first + s + draw(st.sampled_from([0, 1, 9])),  # the prompt's slots, then unwritten ones
        d=draw(st.sampled_from([16, 24])), dv=draw(st.sampled_from([16, 8])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        blocks=draw(st.sampled_from([(16, 16), (32, 16), (16, 32)])), seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


def _inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    q = torch.randn(case["b"], case["heads"], case["s"], case["d"], generator=g).to(DEVICE, case["dtype"])
    k = torch.randn(case["b"], case["kv_heads"], case["length"], case["d"], generator=g).to(DEVICE, case["dtype"])
    v = torch.randn(case["b"], case["kv_heads"], case["length"], case["dv"], generator=g).to(DEVICE, case["dtype"])
    return q, k, v, torch.tensor(case["first"], device=DEVICE)


@settings(max_examples=examples(20), deadline=None)
@given(case=_cases())
def test_equals_the_masked_kernel_and_matches_reference(case):
    q, k, v, first = _inputs(case)
    scale = case["d"] ** -0.5
    bm, bn = case["blocks"]
    out = masked_attention_triton(q, k, v, None, scale, causal_first=first, block_m=bm, block_n=bn)
    assert out.shape == (case["b"], case["heads"], case["s"], case["dv"]) and out.transpose(1, 2).is_contiguous()
    mask = causal_mask_from_first(case["s"], case["length"], first, case["dtype"])
    for closed in (-65504.0, float("-inf")):  # cuDNN's bias, and the math path's
        masked = masked_attention_triton(q, k, v, mask.clamp_min(closed), scale, block_m=bm, block_n=bn)
        assert torch.equal(out, masked)
    tol = tolerance(case["dtype"])
    expected = masked_attention_causal_reference(q, k, v, first, scale)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol.rtol, atol=tol.atol)


def test_default_tiles_and_the_op():
    case = dict(b=1, heads=4, kv_heads=2, s=130, first=0, length=131, d=32, dv=32, dtype=torch.bfloat16,
                seed=3)  # fmt: skip
    q, k, v, first = _inputs(case)
    out = torch.ops.fusion_passes.masked_attention_causal(q, k, v, first, 0.2)
    tol = tolerance(torch.bfloat16)
    expected = masked_attention_causal_reference(q.cpu(), k.cpu(), v.cpu(), first.cpu(), 0.2)
    torch.testing.assert_close(out.float().cpu(), expected.float(), rtol=tol.rtol, atol=tol.atol)
    mask = causal_mask_from_first(130, 131, first, torch.bfloat16)
    assert torch.equal(masked_attention_triton(q, k, v, None, 0.2, causal_first=first), masked_attention_triton(q, k, v, mask, 0.2))


@pytest.mark.parametrize(
    "first,message",
    [(torch.tensor([1, 2]), "one int tensor"), (torch.tensor(1.0), "one int tensor")],
)
def test_bad_first_positions_get_one_line_errors(first, message):
    q, k = torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match=message):
        torch.ops.fusion_passes.masked_attention_causal(q, k, k, first, 0.5)
    with pytest.raises(ValueError, match="masked_attention: 3 query heads are not a multiple of 2"):
        torch.ops.fusion_passes.masked_attention_causal(torch.zeros(1, 3, 3, 8), torch.zeros(1, 2, 4, 8),
                                                        torch.zeros(1, 2, 4, 8), torch.tensor(0), 0.5)  # fmt: skip


def test_opcheck():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 5, 8)
    torch.library.opcheck(torch.ops.fusion_passes.masked_attention_causal.default, (q, k, k.clone(), torch.tensor(1), 0.5))
