"""The chunked rule's input prep kernel (q and k l2-normalized, v copied, all contiguous) against
its plain-torch reference, from views laid out as models leave them: split out of a causal conv's
[B, C, T] output (tokens contiguous), of a [B, T, C] projection (rows contiguous), and contiguous;
on CPU tensors through Triton's interpreter, or compiled on a GPU."""

import os

import torch  # torch does not import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Chosen before triton is first imported; only without a GPU (see test_rms_norm_kernel.py).
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from fusion_passes.lowering.chunk_gated_delta_rule.qkv_prep_triton import qkv_prep_triton  # noqa: E402
from fusion_passes.lowering.chunk_gated_delta_rule.reference import qkv_prep_reference  # noqa: E402

# The normalized q and k are rounded once to the dtype in both; the fp32 sum of squares' order
# differs. bf16 under the interpreter truncates instead of rounding: one ulp.
TOLERANCE = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
EPS = 1e-6


def _views(layout, bsz, tokens, heads, value_heads, dk, dv, dtype, seed):
    """q, k [B, T, H, K] and v [B, T, HV, V] as views of one mixed tensor of H * K + H * K + HV * V
    channels, laid out ``layout``."""
    g = torch.Generator().manual_seed(seed)
    channels = 2 * heads * dk + value_heads * dv
    if layout == "conv":  # transformers: conv output [B, C, T], transposed back, split
        mixed = torch.randn(bsz, channels, tokens, generator=g).to(DEVICE, dtype).transpose(1, 2)
    elif layout == "rows":
        mixed = torch.randn(bsz, tokens, channels, generator=g).to(DEVICE, dtype)
    else:  # three separate contiguous tensors
        q, k = (torch.randn(bsz, tokens, heads, dk, generator=g).to(DEVICE, dtype) for _ in range(2))
        return q, k, torch.randn(bsz, tokens, value_heads, dv, generator=g).to(DEVICE, dtype)
    q, k, v = torch.split(mixed, [heads * dk, heads * dk, value_heads * dv], dim=-1)
    return (q.reshape(bsz, tokens, heads, dk), k.reshape(bsz, tokens, heads, dk),
            v.reshape(bsz, tokens, value_heads, dv))  # fmt: skip


@pytest.mark.parametrize("layout", ["conv", "rows", "contiguous"])
@pytest.mark.parametrize(
    ("bsz", "tokens", "heads", "value_heads", "dk", "dv", "dtype"),
    [(1, 70, 2, 4, 32, 32, torch.bfloat16), (2, 5, 3, 3, 16, 24, torch.float32), (1, 130, 1, 2, 64, 16, torch.float16)],
)  # fmt: skip
def test_matches_reference(layout, bsz, tokens, heads, value_heads, dk, dv, dtype):
    q, k, v = _views(layout, bsz, tokens, heads, value_heads, dk, dv, dtype, seed=tokens)
    got = qkv_prep_triton(q, k, v, EPS)
    want = qkv_prep_reference(q, k, v, EPS)
    rtol, atol = TOLERANCE[dtype]
    for g, w, x in zip(got, want, (q, k, v), strict=True):
        assert g.is_contiguous() and g.shape == x.shape and g.dtype == x.dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=atol)
    assert torch.equal(got[2], v)  # v: a copy
    norms = got[0].float().norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms), rtol=2e-2, atol=2e-2)


def test_a_zero_row_stays_zero_and_the_eps_is_fla_s():
    """A zero head (a padded token) normalizes to zeros (eps under the root), as fla's l2norm_fwd."""
    q, k, v = _views("conv", 1, 9, 2, 2, 16, 16, torch.float32, seed=3)
    q[:, 4] = 0
    got_q = qkv_prep_triton(q, k, v, EPS)[0]
    assert torch.equal(got_q[:, 4], torch.zeros_like(got_q[:, 4]))
    x = q[0, 0, 0].double()
    torch.testing.assert_close(got_q[0, 0, 0].double(), x / (x.square().sum() + EPS).sqrt(), rtol=1e-6, atol=1e-7)


def test_bad_shapes_get_one_line_errors():
    q = torch.zeros(1, 4, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"qkv_prep: q, k \[B, T, H, K\]"):
        qkv_prep_triton(q, torch.zeros(1, 4, 3, 8, device=DEVICE), torch.zeros(1, 4, 2, 8, device=DEVICE), EPS)
