"""The Triton RMSNorm (+ residual add) + FP8 quantization kernel against the plain-torch reference:
on CPU tensors through Triton's interpreter, or on CUDA tensors, compiled, where a GPU is present.

Bit for bit where the reference's activation y can be reproduced exactly; elsewhere within one fp8
code. The kernel sums the squares in another order than torch (numpy's, under the interpreter:
another mean(r^2) for 41% of random fp32 rows of 384), so y, its amax and the scales of random
fp32 rows may differ by an ulp (1 in 4 per-token scales did), and a code may flip where y / scale
lies within that of a rounding boundary (none of 0.9M codes did). Rows of +-2^k make the norm exact
in any order (y = +-weight), and on those every dtype's codes and scales are bit-exact.
"""

import os

import torch  # torch does not import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # The interpreter must be chosen before triton is first imported (fusion_passes imports it).
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton  # noqa: E402 - after the interpreter choice above
import triton.language as tl  # noqa: E402
from _hypothesis import examples  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fusion_passes.numerics import (  # noqa: E402
    fp8_codes_apart,
    fp8_codes_equal,
    fp8_nan_codes,
    ue8m0_quantization_apart,
)

from fusion_passes.lowering.rms_norm_quant_fp8.op import (  # noqa: E402
    add_rms_norm_quant_fp8,
    rms_norm_quant_fp8,
)
from fusion_passes.lowering.common.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, QuantFP8, quant_fp8_reference  # noqa: E402
from fusion_passes.lowering.rms_norm.reference import RMSNormForm  # noqa: E402
from fusion_passes.lowering.rms_norm_quant_fp8.reference import (  # noqa: E402
    add_rms_norm_quant_fp8_reference,
    rms_norm_quant_fp8_reference,
)
from fusion_passes.lowering.rms_norm_quant_fp8 import triton as rms_norm_quant_fp8_triton_module  # noqa: E402
from fusion_passes.lowering.common.fp8_triton import exact_quotient  # noqa: E402
from fusion_passes.lowering.rms_norm_quant_fp8.launch import (  # noqa: E402
    NormQuantLaunch,
    launch_policy,
    launch_shape,
    norm_only_chunks,
    takes_weight_first,
)
from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton  # noqa: E402

# The launch rules measured on an H200 (launch_tables.py), which the launch tests exercise on any
# device; elsewhere the default row applies (test_launch_policy_by_device).
H200 = launch_policy("NVIDIA H200")
MANY_TOKENS, NORM_ONLY_MANY_TOKENS, CHUNKS_MAX = H200.many_tokens, H200.norm_only_many_tokens, H200.chunks_max
from fusion_passes.lowering.rms_norm.reference import (  # noqa: E402
    add_rms_norm_reference,
    rms_norm_reference,
)

# rtol of the dynamic scales (and of new_residual), as test_rms_norm_kernel.py's TOLERANCE: a
# scale is amax(|y|) / 448, so it carries y's error (the interpreter truncates bf16 casts).
RTOL = {
    torch.float32: 1e-5,
    torch.float16: 2 * torch.finfo(torch.float16).eps,
    torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps,
}
DTYPES = list(RTOL)
HIDDEN = {
    "static": [1, 7, 100, 129, 256, 384],
    "per_token": [1, 7, 100, 129, 256, 384],
    "per_group": [128, 256, 384],
}


def _chunk_options(hidden, scheme, group_size):
    """The chunks a norm-only row of hidden columns can be held in (the `chunks` override): 1 (one
    padded block) and every split into at most 8 chunks of a power-of-two width (per_group: of
    >= 2 whole groups)."""
    widths = [1 << k for k in range(hidden.bit_length()) if hidden % (1 << k) == 0 and hidden >> k <= 8]
    if scheme == "per_group":
        widths = [w for w in widths if w % group_size == 0 and w > group_size]
    return [1] + [hidden // w for w in widths if w < hidden]


@st.composite
def _cases(draw, exact_norm):
    """Shapes, dtypes, flags and scheme of one kernel call; inputs are drawn from a per-example
    seed. exact_norm: rows of +-2^k (see _exact_norm_inputs), weight in x.dtype unless fp32."""
    # On CUDA, torch.rsqrt (the reference's) is approximate: rsqrt(4^k) may miss 2^-k by an ulp,
    # which an fp32 y keeps (and a power-of-two scale then lands a binade apart); rounding y to
    # bf16/fp16 absorbs it. So exact-norm rows are exact on CUDA only in bf16/fp16.
    exact_dtypes = DTYPES if DEVICE == "cpu" else [torch.float16, torch.bfloat16]
    dtype = draw(st.sampled_from(exact_dtypes if exact_norm else DTYPES))
    cast_before_weight = draw(st.booleans())
    # The Llama form needs weight in x.dtype and no offset. With exact-norm rows y = +-(weight +
    # offset); rounding that to bf16/fp16 would be a cast the interpreter truncates, so only fp32
    # takes an offset or an fp32 weight there.
    free = not cast_before_weight and (dtype == torch.float32 or not exact_norm)
    scheme = draw(st.sampled_from(list(HIDDEN)))
    hidden = draw(st.sampled_from(HIDDEN[scheme]))
    per_group = scheme == "per_group"
    rows = draw(st.integers(1, 40))
    group_size = draw(st.sampled_from([g for g in (64, 96, 128) if hidden % g == 0])) if per_group else 128
    with_residual = draw(st.booleans())
    return dict(
        shape=(*draw(st.sampled_from([(rows,), (2, rows)])), hidden),
        dtype=dtype,
        weight_dtype=draw(st.sampled_from([dtype, torch.float32])) if free else dtype,
        eps=draw(st.sampled_from([1e-6, 1e-5])),
        weight_offset=draw(st.sampled_from([0.0, 1.0])) if free else 0.0,
        cast_before_weight=cast_before_weight,
        scheme=scheme,
        # Powers of two divide exactly, so y / scale meets fp8 rounding ties; 0.01 does not.
        scale=draw(st.sampled_from([1.0, 2.0**-6, 0.01])) if scheme == "static" else None,
        group_size=group_size,
        scale_ue8m0=draw(st.booleans()) if per_group else False,
        with_residual=with_residual,
        # Norm-only rows also as exact chunks (norm_only_chunks' layout; 1: the padded block).
        chunks=1 if with_residual else draw(st.sampled_from(_chunk_options(hidden, scheme, group_size))),
        # Rows made to depend on the weight's loads or not (takes_weight_first): the same bits.
        weight_first=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _random_inputs(case, g):
    """Standard normal x, weight, residual drawn on the CPU from generator g, moved to DEVICE."""
    shape, dtype = case["shape"], case["dtype"]
    x = torch.randn(shape, generator=g).to(DEVICE, dtype)
    weight = torch.randn(shape[-1], generator=g).to(DEVICE, case["weight_dtype"])
    residual = torch.randn(shape, generator=g).to(DEVICE, dtype) if case["with_residual"] else None
    return x, weight, residual


def _exact_norm_inputs(case, g):
    """Rows r = x + residual of +-2^k, k in 5..8 per row, random signs: mean(r^2) = 4^k exactly in
    any summation order, eps <= 1e-5 vanishes against it (half an fp32 ulp of 4^5 is 6e-5), and
    rstd = 2^-k exactly, so n = +-1 and y = +-(weight + offset) bit for bit in any implementation.
    The weight spans 2^-10..2^2 with bf16's 8 significant bits: many codes are fp8 subnormals, and
    power-of-two scales meet rounding ties."""
    shape, dtype = case["shape"], case["dtype"]
    k = torch.randint(5, 9, (*shape[:-1], 1), generator=g).float()
    r = torch.exp2(k) * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
    magnitude = torch.exp2(torch.randint(-10, 3, (shape[-1],), generator=g).float())
    weight = (torch.randn(shape[-1], generator=g) * magnitude).bfloat16().to(DEVICE, case["weight_dtype"])
    if not case["with_residual"]:
        return r.to(DEVICE, dtype), weight, None
    return (0.75 * r).to(DEVICE, dtype), weight, (0.25 * r).to(DEVICE, dtype)


def _reference_y(case, x, weight, residual):
    """The reference's activation y (x.dtype), before quantization."""
    norm = (case["eps"], case["weight_offset"], case["cast_before_weight"])
    if residual is None:
        return rms_norm_reference(x, weight, *norm)
    return add_rms_norm_reference(x, residual, weight, *norm)[0]


def _run(case, x, weight, residual):
    """(kernel outputs, reference outputs), each (codes, scales, new_residual or None)."""
    scale = None if case["scale"] is None else torch.tensor(case["scale"], device=DEVICE)
    norm = RMSNormForm(case["eps"], case["weight_offset"], case["cast_before_weight"])
    quant = QuantFP8(case["scheme"], scale, case["group_size"], case["scale_ue8m0"])
    out = rms_norm_quant_fp8_triton(
        x, weight, norm, quant, residual, chunks=case.get("chunks"), weight_first=case.get("weight_first"),
        policy=case.get("policy"),
    )
    q, scales, new_residual = out
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and q.is_contiguous()
    assert scales.dtype == torch.float32 and scales.is_contiguous()
    assert (new_residual is None) == (residual is None)
    if residual is None:
        return out, (*rms_norm_quant_fp8_reference(x, weight, norm, quant), None)
    return out, add_rms_norm_quant_fp8_reference(x, residual, weight, norm, quant)


@settings(max_examples=examples(200), deadline=None)
@given(case=_cases(exact_norm=True))
def test_bit_exact_where_the_norm_is_exact(case):
    """Codes, scales and new_residual equal the reference's bit for bit, in every dtype."""
    (q, scales, new_residual), (ref_q, ref_scales, ref_residual) = _run(
        case, *_exact_norm_inputs(case, torch.Generator().manual_seed(case["seed"]))
    )
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert scales.shape == ref_scales.shape and torch.equal(scales, ref_scales)
    assert new_residual is None or torch.equal(new_residual, ref_residual)


@settings(max_examples=examples(200), deadline=None)
@given(case=_cases(exact_norm=False))
def test_random_inputs_within_one_code(case):
    """Codes at most one fp8 code from the reference's, scales within the dtype's tolerance."""
    x, weight, residual = _random_inputs(case, torch.Generator().manual_seed(case["seed"]))
    (q, scales, new_residual), (ref_q, ref_scales, ref_residual) = _run(case, x, weight, residual)
    rtol = RTOL[case["dtype"]]
    assert scales.shape == ref_scales.shape
    if case["scale_ue8m0"]:
        # A scale whose amax / 448 lies within rtol of a power of two may round up to the next one
        # from either side (see ue8m0_quantization_apart).
        y = _reference_y(case, x, weight, residual)
        scales_ok, apart = ue8m0_quantization_apart(q, scales, y, case["group_size"], rtol)
        assert scales_ok and apart <= 1, (scales_ok, apart)
    else:
        torch.testing.assert_close(scales, ref_scales, rtol=rtol, atol=0)
        assert fp8_codes_apart(q, ref_q) <= 1
    if residual is not None:
        torch.testing.assert_close(new_residual.double(), ref_residual.double(), rtol=rtol, atol=1e-5)


def test_launch_policy_by_device():
    """A GPU's launch table row by its name (a longer name of the same GPU too); the default row,
    the padded block's launch at every token count, for any other GPU and for the CPU."""
    default = NormQuantLaunch()
    assert launch_policy("NVIDIA H200 NVL") == H200 and H200.evidence
    assert launch_policy("NVIDIA A100-SXM4-80GB") == default == launch_policy(torch.device("cpu"))
    for tokens in (1, 512, 4096, 16384):
        assert norm_only_chunks(7168, "per_token", 128, tokens, default) == 1
        assert not takes_weight_first(True, "per_token", 1, tokens, default)
        assert launch_shape(1, 7168, tokens, True, default) == launch_shape(1, 7168, None, True, default)


def test_launch_shape():
    """At a static token count >= MANY_TOKENS (with the residual) or >= NORM_ONLY_MANY_TOKENS
    (norm-only) the kernel takes 4 warps; at fewer tokens or a dynamic count the padded block's
    launch_config. The one-shot allreduce kernel, which takes this kernel's default warps, never
    sees MANY_TOKENS rows."""
    from fusion_passes.lowering.allreduce_rms_norm.symm_mem import MAX_ROWS

    assert MANY_TOKENS > MAX_ROWS
    assert NORM_ONLY_MANY_TOKENS < MANY_TOKENS
    for num_groups, group in ((1, 7168), (56, 128), (1, 4096), (1, 3072)):
        default = launch_shape(num_groups, group, policy=H200)
        assert default[3] >= 8  # 16 warps at 7168, 8 at 4096 and 3072
        for tokens in (None, 1, MANY_TOKENS - 1):
            assert launch_shape(num_groups, group, tokens, policy=H200) == default
        assert launch_shape(num_groups, group, MANY_TOKENS, policy=H200) == (*default[:3], 4)
        for tokens in (None, 1, NORM_ONLY_MANY_TOKENS - 1):
            assert launch_shape(num_groups, group, tokens, True, H200) == default
        for tokens in (NORM_ONLY_MANY_TOKENS, MANY_TOKENS):
            assert launch_shape(num_groups, group, tokens, True, H200) == (*default[:3], 4)


def test_norm_only_chunks():
    """Exact chunks for norm-only rows at >= NORM_ONLY_MANY_TOKENS static tokens whose width
    is not a power of two, in chunks of >= CHUNK_MIN columns; per_group only where the padded
    block wastes >= 1/4 of its groups."""
    many = MANY_TOKENS
    assert [norm_only_chunks(7168, s, 128, many, H200) for s in ("static", "per_token", "per_group")] == [7, 7, 1]
    assert [norm_only_chunks(3072, s, 128, many, H200) for s in ("static", "per_token", "per_group")] == [3, 3, 3]
    assert norm_only_chunks(5120, "per_group", 128, many, H200) == 5  # 40 of 64 groups
    assert norm_only_chunks(6144, "per_token", 128, 16384, H200) == 3  # 3 x 2048
    for n in (4096, 2560, 1536, 2880):  # a power of two; chunks of 512 / 512 / 64 < CHUNK_MIN
        assert norm_only_chunks(n, "per_token", 128, many, H200) == 1
    for tokens in (None, 1, NORM_ONLY_MANY_TOKENS - 1):
        assert norm_only_chunks(7168, "per_token", 128, tokens, H200) == 1
    assert norm_only_chunks(7168, "per_token", 128, NORM_ONLY_MANY_TOKENS, H200) == 7
    assert norm_only_chunks(3072, "per_group", 1024, many, H200) == 1  # a chunk of one group
    assert CHUNKS_MAX >= 7


def test_takes_weight_first():
    """Rows depend on the weight's loads with the residual at any token count; norm-only from
    NORM_ONLY_MANY_TOKENS static tokens up to the table's end (16384 on an H200, where it was
    within the spread), in one padded block or per_group chunks, not static or per_token chunks
    (where it measured slower)."""
    for tokens in (None, 1, NORM_ONLY_MANY_TOKENS, MANY_TOKENS):
        for scheme in ("static", "per_token", "per_group"):
            assert takes_weight_first(True, scheme, 1, tokens, H200)
    for tokens in (None, 1, NORM_ONLY_MANY_TOKENS - 1):
        assert not takes_weight_first(False, "per_token", 1, tokens, H200)
    for tokens in (NORM_ONLY_MANY_TOKENS, MANY_TOKENS):
        assert takes_weight_first(False, "per_token", 1, tokens, H200)
        assert takes_weight_first(False, "per_group", 5, tokens, H200)
        assert not takes_weight_first(False, "per_token", 7, tokens, H200)
        assert not takes_weight_first(False, "static", 3, tokens, H200)
    for tokens in (H200.weight_first_norm_only_below, 4 * H200.weight_first_norm_only_below):
        assert not takes_weight_first(False, "per_token", 1, tokens, H200)
        assert takes_weight_first(True, "per_token", 1, tokens, H200)


@pytest.mark.parametrize(
    ("tokens", "scheme", "residual", "expected", "warps"),
    [
        (MANY_TOKENS, "per_token", False, (7, 1, 1024, False), 4),
        (MANY_TOKENS, "per_group", False, (1, 64, 128, True), 4),
        (MANY_TOKENS, "per_token", True, (1, 1, 8192, True), 4),
        (NORM_ONLY_MANY_TOKENS, "per_token", False, (7, 1, 1024, False), 4),
        (NORM_ONLY_MANY_TOKENS - 1, "per_token", False, (1, 1, 8192, False), 16),
        (2048, "per_token", True, (1, 1, 8192, True), 16),  # the one-shot allreduce kernel's warps
    ],
)
def test_launch_takes_the_chunks(monkeypatch, tokens, scheme, residual, expected, warps):
    """The launch of 7168 columns (recorded, not run): (CHUNKS, BLOCK_GROUPS, BLOCK_GROUP,
    WEIGHT_FIRST), warps."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(rms_norm_quant_fp8_triton_module, "_rms_norm_quant_fp8_kernel", Recorder())
    x = torch.zeros(tokens, 7168, dtype=torch.bfloat16)
    rms_norm_quant_fp8_triton(
        x, torch.ones(7168, dtype=torch.bfloat16), RMSNormForm(1e-6, 0.0, True), QuantFP8(scheme),
        residual=x if residual else None, policy=H200,
    )
    (kwargs,) = launches
    launch = ("CHUNKS", "BLOCK_GROUPS", "BLOCK_GROUP", "WEIGHT_FIRST")
    assert tuple(kwargs[name] for name in launch) == expected
    assert kwargs["num_warps"] == warps


@pytest.mark.parametrize(
    ("scheme", "chunks", "with_residual"),
    [("per_token", 3, False), ("per_token", 2, True), ("per_group", 2, False), ("per_group", 3, False)],
)
def test_chunks_that_do_not_split_raise(scheme, chunks, with_residual):
    """256 columns: 3 chunks are not a power-of-two width; 2 chunks of 128 hold one group of 128,
    not two; a residual takes the padded block only."""
    x = torch.randn(2, 256).to(DEVICE)
    with pytest.raises(ValueError) as raised:
        rms_norm_quant_fp8_triton(
            x, torch.ones(256, device=DEVICE), RMSNormForm(1e-6), QuantFP8(scheme),
            x if with_residual else None, chunks=chunks,
        )  # fmt: skip
    assert "\n" not in str(raised.value)


# The interpreter ignores num_warps, so on CPU this only checks the launch; it runs the cheap
# static scheme there (the amax's custom reduction takes ~18 s per scheme at this size), and by
# default only the padded launch: the 3 chunks of 3072 columns take ~16 s (slow; hypothesis'
# cases hold norm-only rows in chunks at a few rows).
_MANY_TOKENS_CASES = [
    # (rows, hidden, group_size, with_residual): MANY_TOKENS rows of 128 (the 4-warp padded
    # launch, both forms); NORM_ONLY_MANY_TOKENS norm-only rows of 3072 (3 chunks of 1024, 4 warps)
    (MANY_TOKENS, 128, 64, False),
    (MANY_TOKENS, 128, 64, True),
    (NORM_ONLY_MANY_TOKENS, 3072, 128, False),
]
_NORM_ONLY_CHUNKS = {128: 1, 3072: 3}  # the norm-only launch's chunks a row, by hidden


@pytest.mark.parametrize(
    ("scheme", "rows", "hidden", "group_size", "with_residual"),
    [(s, *c) for s in ("static", "per_token", "per_group") for c in _MANY_TOKENS_CASES]
    if DEVICE == "cuda"
    else [
        pytest.param("static", *c, marks=() if c[1] == 128 else pytest.mark.slow)
        for c in _MANY_TOKENS_CASES
        if not c[3]
    ],
)
def test_at_many_tokens(scheme, rows, hidden, group_size, with_residual):
    """The default launch at many static tokens: codes within one of the reference's, scales and
    new_residual within bf16's tolerance."""
    if not with_residual:
        assert norm_only_chunks(hidden, scheme, group_size, rows, H200) == _NORM_ONLY_CHUNKS[hidden]
    case = dict(policy=H200, shape=(rows, hidden), dtype=torch.bfloat16, weight_dtype=torch.bfloat16,
                eps=1e-6, weight_offset=0.0, cast_before_weight=True, scheme=scheme,
                scale=0.01 if scheme == "static" else None, group_size=group_size, scale_ue8m0=False,
                with_residual=with_residual)  # fmt: skip
    (q, scales, new_residual), (ref_q, ref_scales, ref_residual) = _run(
        case, *_random_inputs(case, torch.Generator().manual_seed(4))
    )
    torch.testing.assert_close(scales, ref_scales, rtol=RTOL[torch.bfloat16], atol=0)
    assert fp8_codes_apart(q, ref_q) <= 1
    if with_residual:
        torch.testing.assert_close(new_residual, ref_residual, rtol=RTOL[torch.bfloat16], atol=1e-5)


def _fp8_boundaries():
    """fp32 values around every fp8 rounding decision: each finite e4m3 value, each midpoint
    between neighbours (ties, to even), the fp32 values next to each midpoint, and values past 448
    (clamped); both signs."""
    values = torch.arange(127, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0 .. 448
    midpoints = (values[1:] + values[:-1]) / 2
    up, down = torch.full_like(midpoints, 1e30), torch.zeros_like(midpoints)
    beyond = torch.tensor([448.5, 464.0, 480.0, 1e4])
    positive = [values, midpoints, midpoints.nextafter(up), midpoints.nextafter(down), beyond]
    return torch.cat([torch.cat(positive), -torch.cat(positive)])


@pytest.mark.parametrize("with_residual", [False, True])
def test_fp8_rounding_exhaustive(with_residual):
    """Every fp8 rounding decision, ties to even, subnormals and the clamp, through the static
    scheme with scale 1: rows of +-32 give y = +-weight exactly (see _exact_norm_inputs)."""
    weight = _fp8_boundaries().to(DEVICE)
    sign = torch.tensor([[1.0], [-1.0]], device=DEVICE)
    x = 32.0 * sign.expand(2, weight.shape[0])
    case = dict(
        eps=1e-6, weight_offset=0.0, cast_before_weight=True, scheme="static", scale=1.0,
        group_size=128, scale_ue8m0=False,
    )  # fmt: skip
    residual = -x if with_residual else None
    (q, _, _), (ref_q, _, _) = _run(case, 2 * x if with_residual else x, weight, residual)
    assert torch.equal(
        ref_q[0].view(torch.uint8), weight.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
    )
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


# Static scales a calibration gives (0.01, 2^-3), a negative one, and the ones outside the fma
# quotient's range, which take div.rn on a GPU: tiny, subnormal, zero, huge, infinite.
@pytest.mark.parametrize("scale", [0.01, 2.0**-3, -3.0, 2.0**-110, 1e-40, 0.0, 2.0**110, float("inf")])
def test_static_scales_of_any_size(scale):
    """The static scheme over activations from 2^-40 to 3e38 (rows of +-32 give y = +-weight
    exactly): codes bit-equal to the reference's, quotients past +-448 clamped (y / scale
    overflowing to inf included), and a zero activation over a zero scale (0 / 0) a NaN code."""
    g = torch.Generator().manual_seed(5)
    magnitude = torch.exp2(torch.randint(-40, 41, (512,), generator=g).float()) * (
        1 + torch.rand(512, generator=g)
    )
    weight = torch.cat([magnitude, torch.tensor([3e38, 1e-30, 448.0, 449.0, 1.0, 0.0])])
    weight = (weight * torch.where(torch.rand(weight.shape, generator=g) < 0.5, -1.0, 1.0)).bfloat16().float()
    x = 32.0 * torch.tensor([[1.0], [-1.0]]).expand(2, weight.shape[0])
    case = dict(
        eps=1e-6, weight_offset=0.0, cast_before_weight=True, scheme="static", scale=scale,
        group_size=128, scale_ue8m0=False,
    )  # fmt: skip
    (q, _, _), (ref_q, _, _) = _run(case, x.to(DEVICE), weight.to(DEVICE), None)
    assert fp8_codes_equal(q, ref_q) and fp8_nan_codes(ref_q).any() == (scale == 0.0)


@pytest.mark.parametrize(
    ("scheme", "group_size", "scale_ue8m0"),
    [("per_token", 128, False), ("per_group", 128, False), ("per_group", 64, True)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows_take_the_min_scale(scheme, group_size, scale_ue8m0, dtype):
    """A row whose residual sum is zero has amax 0: its scales are MIN_SCALE (2^-17 under UE8M0,
    the next power of two), its codes +-0, none NaN; the other rows are untouched."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=g).to(DEVICE, dtype)
    residual = torch.randn(5, 256, generator=g).to(DEVICE, dtype)
    x[1], x[3] = -residual[1], 0.0
    residual[3] = 0.0
    case = dict(
        eps=1e-6, weight_offset=0.0, cast_before_weight=False, scheme=scheme, scale=None,
        group_size=group_size, scale_ue8m0=scale_ue8m0,
    )  # fmt: skip
    weight = torch.randn(256, generator=g).to(DEVICE, dtype)
    (q, scales, _), (ref_q, ref_scales, _) = _run(case, x, weight, residual)
    expected = 2.0**-17 if scale_ue8m0 else torch.tensor(MIN_SCALE).item()
    for s in (scales, ref_scales):
        assert torch.all(s[[1, 3]] == expected) and torch.all(s[[0, 2, 4]] > expected)
    assert torch.all(q[[1, 3]].float() == 0) and not q.float().isnan().any()
    assert fp8_codes_apart(q, ref_q) <= (0 if dtype == torch.float32 else 1)


@pytest.mark.parametrize(
    ("scheme", "group_size", "scale_ue8m0"),
    [("static", 128, False), ("per_token", 128, False), ("per_group", 128, False), ("per_group", 64, True)],
)
@pytest.mark.parametrize(("with_residual", "chunked"), [(False, False), (False, True), (True, False)])
def test_nan_propagates_as_in_torch(scheme, group_size, scale_ue8m0, with_residual, chunked):
    """A NaN weight column makes that column of y NaN (rows of +-32: y = +-weight exactly
    elsewhere). As in torch, its code is NaN and, for the computed scales, so are the amax and
    the scale of every row (per_token) or of its group (per_group), and so every code they
    scale; the rest is bit-exact. (A max instruction that drops NaN would give a finite scale
    and, with a clamp of max instructions, the code -448.)"""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(256, generator=g).bfloat16()
    weight[5] = float("nan")
    x = 32.0 * (torch.randint(0, 2, (6, 256), generator=g) * 2 - 1).bfloat16()
    residual = None
    if with_residual:
        x, residual = (0.75 * x).to(DEVICE), (0.25 * x).to(DEVICE)
    case = dict(
        eps=1e-6, weight_offset=0.0, cast_before_weight=True, scheme=scheme,
        scale=0.5 if scheme == "static" else None, group_size=group_size, scale_ue8m0=scale_ue8m0,
        # The most chunks (8 of 32; per_group 64: 2 of 128; per_group 128 has none: the padded block).
        chunks=max(_chunk_options(256, scheme, group_size)) if chunked else None,
    )  # fmt: skip
    (q, scales, _), (ref_q, ref_scales, _) = _run(case, x.to(DEVICE), weight.to(DEVICE), residual)
    expected_nan = {"static": 1, "per_token": 256, "per_group": group_size}[scheme]
    assert torch.all(fp8_nan_codes(ref_q).sum(-1) == expected_nan)
    assert fp8_codes_equal(q, ref_q)
    torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0, equal_nan=True)


def test_strided_inputs_fully_written(monkeypatch):
    """Row-strided views are read in place; outputs allocated NaN-filled come back NaN-free."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else 0x7F)  # 0x7F: the fp8 NaN

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 300, generator=g).to(DEVICE, torch.float16)[:, 20:276]
    residual = torch.randn(37, 256, generator=g).to(DEVICE, torch.float16).t().contiguous().t()
    weight = torch.randn(512, generator=g).to(DEVICE)[::2]
    case = dict(
        eps=1e-6, weight_offset=1.0, cast_before_weight=False, scheme="per_group", scale=None,
        group_size=64, scale_ue8m0=False,
    )  # fmt: skip
    (q, scales, new_residual), (ref_q, ref_scales, _) = _run(case, x, weight, residual)
    assert not (q.float().isnan().any() or scales.isnan().any() or new_residual.isnan().any())
    assert fp8_codes_apart(q, ref_q) <= 1
    torch.testing.assert_close(scales, ref_scales, rtol=RTOL[torch.float16], atol=0)


@pytest.mark.parametrize(
    ("scheme", "scale", "group_size", "scale_ue8m0"),
    [
        ("static", torch.tensor(0.02), 128, False),
        ("per_token", None, 128, False),
        ("per_group", None, 64, True),
    ],
)
def test_ops_match_the_reference_and_fake(scheme, scale, group_size, scale_ue8m0):
    """The custom ops: schema, fake (shapes, dtypes, strides) and dispatch checked by opcheck; on
    DEVICE they return the reference's outputs (CPU) or the kernel's (CUDA), none aliasing inputs."""
    g = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(2, 3, 128, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    weight = torch.randn(128, generator=g).to(DEVICE, torch.bfloat16)
    scale = None if scale is None else scale.to(DEVICE)
    quant = (scheme, scale, group_size, scale_ue8m0)
    torch.library.opcheck(rms_norm_quant_fp8, (x, weight, 1e-6, 0.0, True, *quant))
    torch.library.opcheck(add_rms_norm_quant_fp8, (x, residual, weight, 1e-6, 0.0, True, *quant))
    q, scales, new_residual = add_rms_norm_quant_fp8(x, residual, weight, 1e-6, 0.0, True, *quant)
    ref_q, ref_scales, ref_residual = add_rms_norm_quant_fp8_reference(
        x, residual, weight, RMSNormForm(1e-6, 0.0, True), QuantFP8(*quant)
    )
    assert scales is not scale and scales.shape == ref_scales.shape
    torch.testing.assert_close(scales, ref_scales, rtol=RTOL[torch.bfloat16], atol=0)
    assert fp8_codes_apart(q, ref_q) <= 1
    torch.testing.assert_close(new_residual, ref_residual, rtol=RTOL[torch.bfloat16], atol=1e-5)


@pytest.mark.parametrize(
    ("scheme", "scale", "group_size", "scale_ue8m0"),
    [
        ("per_channel", None, 128, False),  # unknown scheme
        ("static", None, 128, False),  # static without its scale
        ("per_token", torch.tensor(1.0), 128, False),  # a dynamic scheme given a scale
        ("static", torch.tensor(1.0, dtype=torch.float16), 128, False),  # scale not fp32
        ("static", torch.ones(2), 128, False),  # scale of two elements
        ("per_group", None, 96, False),  # group size not dividing 256
        ("per_group", None, 0, False),  # no columns a group
    ],
)
def test_bad_arguments_raise(scheme, scale, group_size, scale_ue8m0):
    x = torch.randn(2, 256).to(DEVICE)
    weight, scale = torch.ones(256, device=DEVICE), None if scale is None else scale.to(DEVICE)
    for call in (
        lambda: rms_norm_quant_fp8_triton(
            x, weight, RMSNormForm(1e-6), QuantFP8(scheme, scale, group_size, scale_ue8m0)
        ),
        lambda: quant_fp8_reference(x, QuantFP8(scheme, scale, group_size, scale_ue8m0)),
    ):
        with pytest.raises(ValueError) as raised:
            call()
        assert "\n" not in str(raised.value)


@triton.jit
def _quotients_kernel(y_ptr, scale_ptr, fma_ptr, div_ptr, n_y, BLOCK: tl.constexpr):
    """For one scale (program 1) and BLOCK numerators (program 0): exact_quotient's and div_rn's
    y / scale, as fp32 bits."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_y
    y = tl.load(y_ptr + offs, mask=mask, other=1.0)[None, None, :]
    scale = tl.load(scale_ptr + tl.program_id(1) + tl.zeros((1, 1), tl.int32))
    out = tl.program_id(1).to(tl.int64) * n_y + offs
    tl.store(fma_ptr + out, tl.reshape(exact_quotient(y, scale), (BLOCK,)), mask=mask)
    tl.store(div_ptr + out, tl.reshape(tl.div_rn(y, scale[:, :, None]), (BLOCK,)), mask=mask)


@pytest.mark.gpu
def test_exact_quotient_is_div_rn():
    """The fma quotient the compiled kernels use (exact_quotient) against div.rn: every finite
    bf16 numerator (the activations of a bf16 model), 2^18 random fp32 ones spread over 2^-100..
    2^100 and zeros of both signs, over 981 scales (amax / 448 of random amaxes, powers of two,
    MIN_SCALE, the largest computed scale, inf and NaN). Where |y| >= 2^-100 and 2^-100 <=
    |y / scale| <= 2^100 (the kernels' quotients are at most 448): the same fp32 bits, or both
    NaN; for smaller y or quotients: the same fp8 codes (signed zeros)."""
    g = torch.Generator().manual_seed(0)
    bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    magnitude = torch.exp2(torch.empty(2**18).uniform_(-100, 100, generator=g))
    signs = torch.where(torch.rand(2**18, generator=g) < 0.5, -1.0, 1.0)
    y = torch.cat([bf16[bf16.isfinite()], magnitude * signs, torch.tensor([0.0, -0.0])])
    amax = torch.exp2(torch.empty(900).uniform_(-30, 30, generator=g)).bfloat16().float()
    scales = torch.cat([
        amax * (1.0 / FP8_MAX), torch.exp2(torch.arange(-17.0, 60.0, 1.0)),
        torch.tensor([MIN_SCALE, torch.finfo(torch.float32).max / FP8_MAX, float("inf"), float("nan")]),
    ])  # fmt: skip
    y, scales = y.cuda(), scales.cuda()
    fma, div = (torch.empty(scales.numel(), y.numel(), device="cuda") for _ in range(2))
    block = 1024
    _quotients_kernel[(triton.cdiv(y.numel(), block), scales.numel())](
        y, scales, fma, div, y.numel(), BLOCK=block
    )
    ratio = y.abs()[None, :] / scales[:, None]  # inf past fp32's range: left out below
    special = ~scales.isfinite()[:, None]
    normal = (special | ((ratio >= 2.0**-100) & (ratio <= 2.0**100))) & (y.abs() >= 2.0**-100)[None, :]
    same = (fma.view(torch.int32) == div.view(torch.int32)) | (fma.isnan() & div.isnan())
    differ = ~same & normal
    assert not bool(differ.any()), (
        f"{int(differ.sum())} of {int(normal.sum())} quotients differ; |y| from "
        f"{y.abs().expand_as(differ)[differ].min().item():.3g}, |y / scale| from {ratio[differ].min().item():.3g}"
    )
    tiny = ~special & (ratio <= 2.0**100) & ~normal
    codes = [t[tiny].clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8) for t in (fma, div)]
    assert int(tiny.sum()) > 0 and torch.equal(*codes)
