"""The SiLU + FP8 kernel's silu against torch's CUDA silu on every input, in each of its forms
(silu_mul_quant_fp8/silu.py.SILU_FORMS): all 2^32 fp32 bit patterns, and every bf16 and fp16
value, bit for bit (NaN as any NaN).

silu_quotient divides without div.rn's per-element range check and slow path; its docstring
argues from fp32's normal range why the fast sequence is still the correctly rounded quotient.
Exhausting the inputs turns that argument into a check: every zero's sign, the subnormals, the
range where 1 + expf(-x) passes 2^100 or overflows, and both infinities are among them. The
bf16_mufu form is not eager's fp32 silu at all; that it rounds to eager's bf16 silu is a fact
about this GPU's approximations, and every bf16 input is checked. About 40 ms of GPU time per
2^28 inputs on an H200.
"""

import os

import torch  # torch does not import triton

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # collected on the CPU too, where it is skipped

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fusion_passes.lowering.silu_mul_quant_fp8.silu import SILU_FORMS, silu_rounded  # noqa: E402

pytestmark = pytest.mark.gpu
CHUNK = 1 << 28  # inputs per launch: 1 GiB of fp32 in, 1 GiB out


@triton.jit
def _silu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, SILU_FORM: tl.constexpr):
    """out = silu_rounded(x) in fp32 (the value the SiLU + FP8 kernel multiplies by up)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, silu_rounded(x, x_ptr.dtype.element_ty, True, SILU_FORM), mask=mask)


def _kernel_silu(x: torch.Tensor, form: str) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(x.numel(), 1024),)
    _silu_kernel[grid](x, out, x.numel(), BLOCK=1024, SILU_FORM=SILU_FORMS[form], num_warps=4)
    return out


def _differing(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Indices where got and want differ in their bits, NaN against NaN of any payload counted equal."""
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    return (~same).nonzero().flatten()


@pytest.mark.parametrize("form", ["div_rn", "silu_quotient"])
def test_silu_equals_torch_on_every_fp32_input(form):
    """All 2^32 fp32 bit patterns, in 16 launches of 2^28, by either division."""
    mismatches, first = 0, None
    for start in range(-(1 << 31), 1 << 31, CHUNK):
        bits = torch.arange(start, start + CHUNK, dtype=torch.int64, device="cuda").to(torch.int32)
        x = bits.view(torch.float32)
        bad = _differing(_kernel_silu(x, form), F.silu(x))
        mismatches += bad.numel()
        if first is None and bad.numel():
            first = x[bad[0]].item()
        del bits, x
    assert mismatches == 0, f"{mismatches} fp32 inputs differ from torch's silu, the first {first!r}"


@pytest.mark.parametrize(
    ("dtype", "form"),
    [(torch.bfloat16, f) for f in SILU_FORMS] + [(torch.float16, "div_rn"), (torch.float16, "silu_quotient")],
    ids=str,
)
def test_silu_equals_torch_on_every_16_bit_input(dtype, form):
    """Every bf16 / fp16 value: the kernel's silu, rounded to the dtype, is eager's F.silu."""
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device="cuda").to(torch.int16).view(dtype)
    bad = _differing(_kernel_silu(x, form), F.silu(x).float())
    assert bad.numel() == 0, f"{bad.numel()} {dtype} inputs differ, the first {x[bad[0]].item()!r}"
