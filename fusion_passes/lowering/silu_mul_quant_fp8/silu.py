"""Eager's silu in Triton, bit for bit on a GPU: ``to_dtype(f32(x) / (1 + expf(-f32(x))))``, the
formula and roundings of torch's CUDA silu (opmath fp32, then the input dtype), in three forms
(SILU_FORMS), each checked on every input (tests/silu_mul_quant_fp8/test_gpu_silu_exact.py):

    div_rn         libdevice's expf (torch's ::expf) and div.rn, as nvcc compiles eager's silu
    silu_quotient  the same expf, and div.rn's quotient without its per-element slow-path branch
                   (fewer registers: the kernels' choice where registers bind)
    bf16_mufu      bf16 on sm_90: ex2.approx / rcp.approx, 8 instructions for the ~20 of the
                   others; not eager's fp32 value, but rounded to bf16 eager's on all 65536 inputs

Under the CPU interpreter (not HW_CONVERT) silu_rounded uses numpy's exp and div_rn, a few fp32
ulps from torch's CPU silu.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# silu_rounded's forms (SILU_FORM); SILU_FORMS names them for the launcher's `form` argument.
FORM_DIV_RN = tl.constexpr(0)
FORM_SILU_QUOTIENT = tl.constexpr(1)
FORM_BF16_MUFU = tl.constexpr(2)
SILU_FORMS = {"div_rn": 0, "silu_quotient": 1, "bf16_mufu": 2}
# Devices (compute capability) where _silu_bf16_mufu rounds to eager's bf16 silu on every input,
# checked exhaustively on an H200 (tests/silu_mul_quant_fp8/test_gpu_silu_exact.py); elsewhere bf16 takes expf.
# At 18432 columns and 4096 tokens (one H200, us), static / per_group / per_token took 90.4 /
# 91.3 / 117.5 with it against 106.1 / 107.8 / 175.2 with expf and div.rn.
_BF16_MUFU_CAPABILITIES = frozenset({(9, 0)})


@triton.jit
def round_to(v, dtype: tl.constexpr, HW_CONVERT: tl.constexpr):
    """fp32 v rounded to dtype (to nearest, ties to even), returned as fp32: where eager rounds.

    Under the interpreter Triton 3.6 truncates fp32 -> bf16 (probed: 50% of N(0, 16) values came
    out one bf16 ulp low), so bf16 is rounded there by integer steps: add 0x7FFF plus the lowest
    kept bit (ties to even), drop the 16 low bits; an overflow carries into inf as the cast does.
    fp16 casts round correctly in the interpreter (numpy's). HW_CONVERT: the GPU's cvt.rn."""
    if dtype == tl.float32:
        return v
    if dtype == tl.bfloat16 and not HW_CONVERT:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536: 0xFFFF0000 as int32
        return bits.to(tl.float32, bitcast=True)
    return v.to(dtype).to(tl.float32)


# silu_quotient's range: d = 1 + expf(-x) up to 2^100 (x >= -69.3) divides as it is; beyond, x
# and d are scaled by 2^-64 first (exact: |x| >= 69 and d > 2^100 stay normal).
_TWO_POW_100 = tl.constexpr(2.0**100)
_TWO_POW_MINUS_64 = tl.constexpr(2.0**-64)


@triton.jit
def _rcp_approx(d):
    """rcp.approx.ftz.f32: one MUFU.RCP, within an ulp of 1 / d, +0 for +inf (Triton's 1.0 / d
    would be div.full.f32, which adds range scaling)."""
    return tl.inline_asm_elementwise(
        "rcp.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def silu_quotient(x, d):
    """RN(x / d) for d = 1 + expf(-x) (silu's division), bit for bit as div.rn gives it, with no
    branch: the SiLU + FP8 kernel's choice where registers bind
    (silu_mul_quant_fp8_triton._NO_SLOW_PATH_MIN_LANES).

    div.rn compiles to MUFU.RCP, two FFMA refining the reciprocal, three FFMA for the quotient and
    its correction, guarded per element by FCHK and a branch to a called slow path; that call
    pins registers: the per_token kernel at intermediate 18432 (16 warps) took 115 registers, one
    program an SM, 62 with this (sm_90 SASS). The same FFMA sequence is the correctly rounded
    quotient whenever nothing leaves fp32's normal range, which silu's operands give:
    - d in [1, 2^100] (x >= -69.3): 1 / d is normal; x / d is normal or, for |x| < 2^-25, where
      expf(-x) = 1 and d = 2, x * 0.5, which the fma computes exactly and rounds once;
    - d in (2^100, inf) (x in (-88.7, -69.3)): x and d scaled by 2^-64 first (exact; the same
      quotient);
    - the sequence's NaNs are its special cases: d = inf (x < -88.7: x / inf is -0, NaN for
      -inf) and x = +inf (inf / 1: the correction's inf - inf), each x * (1 / d) with the MUFU's
      reciprocal (+0 for inf), as a NaN x is.
    The residual is carried negated (as exact_quotient does) so a zero x keeps its sign. Checked
    against torch's CUDA silu on all 2^32 fp32 inputs (tests/silu_mul_quant_fp8/test_gpu_silu_exact.py). Compiled
    for a GPU only: the interpreter's fma rounds the product first."""
    factor = tl.where(d > _TWO_POW_100, _TWO_POW_MINUS_64, 1.0)
    x_s = x * factor
    d_s = d * factor
    r0 = _rcp_approx(d_s)
    rcp = tl.fma(tl.fma(d_s * -1.0, r0, 1.0), r0, r0)  # 1 / d_s to about half an ulp
    q0 = x_s * rcp
    neg_residual = tl.fma(q0, d_s, x_s * -1.0)  # exact: q0 is within an ulp of x_s / d_s
    q = tl.fma(neg_residual * -1.0, rcp, q0)
    return tl.where(q != q, x_s * r0, q)


@triton.jit
def _silu_bf16_mufu(x):
    """silu of a bf16 x (in fp32) from the multi-function unit's approximations: x * -log2(e),
    ex2.approx, 1 + e, and a division as div.full.f32 does it (rcp.approx, operands scaled by 1/4
    when d > 2^126, where the reciprocal would flush): 8 instructions where expf and div.rn take
    about 20. Not eager's fp32 silu (a few ulps apart, more where x * log2(e) rounds at large |x|),
    but rounded to bf16 it is eager's on every one of the 65536 bf16 inputs on sm_90 (an H200;
    tests/silu_mul_quant_fp8/test_gpu_silu_exact.py): the kernel takes it only there, for bf16 (fp16 missed on 2
    inputs), as _BF16_MUFU_CAPABILITIES says. Inline PTX with .rn arithmetic: the exact
    instructions that were checked, no contraction into an fma, no lowering choice left to the
    compiler."""
    return tl.inline_asm_elementwise(
        """{
        .reg .f32 e, d, x;
        .reg .pred big;
        mul.rn.f32 e, $1, 0fBFB8AA3B;
        ex2.approx.ftz.f32 e, e;
        add.rn.f32 d, e, 0f3F800000;
        mov.f32 x, $1;
        setp.gt.f32 big, d, 0f7E800000;
        @big mul.rn.f32 d, d, 0f3E800000;
        @big mul.rn.f32 x, x, 0f3E800000;
        rcp.approx.ftz.f32 d, d;
        mul.rn.f32 $0, d, x;
        }""",
        "=f,f",
        [x],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def silu_rounded(gate, dtype: tl.constexpr, HW_CONVERT: tl.constexpr, SILU_FORM: tl.constexpr):
    """fp32 to_dtype(f32(gate) / (1 + exp(-f32(gate)))): F.silu, rounded where eager rounds.
    SILU_FORM (with HW_CONVERT; all three give eager's bits): FORM_DIV_RN, libdevice's expf and
    div.rn; FORM_SILU_QUOTIENT, expf and silu_quotient; FORM_BF16_MUFU, _silu_bf16_mufu (bf16)."""
    if not HW_CONVERT:
        return round_to(tl.div_rn(gate, 1.0 + tl.exp(-gate)), dtype, HW_CONVERT)
    if SILU_FORM == FORM_BF16_MUFU:
        return round_to(_silu_bf16_mufu(gate), dtype, HW_CONVERT)
    # __nv_expf, as torch's CUDA silu (tl.exp is ex2.approx: ~2 ulp); correctly rounded
    # division, as nvcc's default (Triton's '/' is div.full.f32, 2 ulp). gate * -1.0, not -gate
    # (Triton's 0 - x): the negation folds into expf's first fma (the same e: expf(+-0) = 1).
    d = 1.0 + libdevice.exp(gate * -1.0)
    if SILU_FORM == FORM_SILU_QUOTIENT:
        q = silu_quotient(gate, d)
    else:
        q = tl.div_rn(gate, d)
    return round_to(q, dtype, HW_CONVERT)


def takes_mufu_silu(dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """Whether silu is the bf16_mufu form: bf16 on a device of _BF16_MUFU_CAPABILITIES
    (capability None: not a GPU)."""
    return dtype == torch.bfloat16 and capability in _BF16_MUFU_CAPABILITIES
