"""The Triton kernels of the DeepSeek MLA / V3.2 indexer pre-attention ops against their plain-torch
references: on CPU tensors through Triton's interpreter, or on CUDA tensors where a GPU is present.

RoPE outputs are bit-exact in every dtype (the kernels round each product and sum where eager
does). Norm outputs are bit-exact where the reduction order cannot matter and otherwise within one
ulp of x.dtype: the kernel sums the squares / deviations in another order than torch.
"""

import os
import re

import torch  # torch does not import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from fusion_passes.lowering.mla_rope.op import (  # noqa: E402
    mla_indexer_qk_rope,
    mla_kv_cache_write,
    mla_indexer_k_norm_rope,
    mla_indexer_k_norm_rope_cache,
    mla_kv_norm_rope,
    mla_q_kv_rope,
    mla_q_rope,
)
from fusion_passes.lowering.mla_rope.reference import (  # noqa: E402
    mla_indexer_qk_rope_reference,
    mla_kv_cache_write_reference,
    mla_indexer_k_norm_rope_cache_reference,
    mla_indexer_k_norm_rope_reference,
    mla_kv_norm_rope_reference,
    mla_q_kv_rope_reference,
    mla_q_rope_reference,
    rope_reference,
)
from fusion_passes.lowering.mla_rope.triton import (  # noqa: E402
    mla_indexer_qk_rope_triton,
    mla_kv_cache_write_triton,
    mla_indexer_k_norm_rope_cache_triton,
    mla_indexer_k_norm_rope_triton,
    mla_kv_norm_rope_triton,
    mla_q_kv_rope_triton,
    mla_q_rope_triton,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
# (kv_lora_rank R, rope P, heads H, nope dim): DeepSeek V3's widths scaled down, the tiny config,
# and odd sizes (R and nope not powers of two, one head).
CONFIGS = [(512, 64, 2, 128), (32, 16, 4, 32), (48, 8, 1, 24), (100, 32, 3, 40)]


def _cos_sin(lead, c, dtype, g, batch_broadcast=False):
    """HF-like cos/sin rows (values of cos/sin of random angles), cast to dtype."""
    shape = (1, *lead[1:], c) if batch_broadcast else (*lead, c)
    angle = torch.rand(shape, generator=g) * 100
    return angle.cos().to(DEVICE, dtype), angle.sin().to(DEVICE, dtype)


def _within_ulp(a, b, dtype, ulps=1):
    diff = (a.double() - b.double()).abs()
    return bool(torch.all(diff <= ulps * ULP[dtype] * b.double().abs().clamp_min(1e-3)))


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("interleave", [True, False], ids=["interleave", "rotate_half"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_norm_rope(dtype, interleave, config):
    r, p, _, _ = config
    g = torch.Generator().manual_seed(r + p)
    lead = (2, 5)
    kv = torch.randn(*lead, r + p, generator=g).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(r, generator=g)).to(DEVICE, dtype)
    cos, sin = _cos_sin(lead, p // 2 if interleave else p, dtype, g)
    normed, k_pe = mla_kv_norm_rope_triton(kv, weight, cos, sin, 1e-6, 0.0, True, interleave)
    ref_normed, ref_pe = mla_kv_norm_rope_reference(kv, weight, cos, sin, 1e-6, 0.0, True, interleave)
    assert normed.shape == (*lead, r) and k_pe.shape == (*lead, p)
    assert normed.is_contiguous() and k_pe.is_contiguous()
    assert torch.equal(k_pe, ref_pe)
    assert _within_ulp(normed, ref_normed, dtype, ulps=2)


@pytest.mark.parametrize("form", [(0.0, False), (1.0, False)], ids=["fp32_weight", "offset"])
def test_kv_norm_forms_and_strided_rows(form):
    """The fp32-weight and (1 + w) forms; kv a row-strided view, cos broadcast over the batch."""
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(3, 4, 100, generator=g).to(DEVICE, torch.bfloat16)[..., 10:90]
    weight = torch.randn(64, generator=g).to(DEVICE)
    cos, sin = _cos_sin((3, 4), 8, torch.bfloat16, g, batch_broadcast=True)
    out = mla_kv_norm_rope_triton(kv, weight, cos, sin, 1e-5, *form, True)
    ref = mla_kv_norm_rope_reference(kv, weight, cos, sin, 1e-5, *form, True)
    assert torch.equal(out[1], ref[1])
    assert _within_ulp(out[0], ref[0], torch.bfloat16, ulps=2)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("layout", ["mla", "indexer"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleave", "rotate_half"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_rope_bit_exact(dtype, interleave, layout, config):
    _, p, h, nope = config
    g = torch.Generator().manual_seed(h + nope)
    b, s = 2, 3
    q = torch.randn(b, s, h, nope + p, generator=g).to(DEVICE, dtype)
    cos, sin = _cos_sin((b, s), p // 2 if interleave else p, dtype, g)
    rope_first, heads_first = (False, True) if layout == "mla" else (True, False)
    out = mla_q_rope_triton(q, cos, sin, rope_first, interleave, heads_first)
    ref = mla_q_rope_reference(q, cos, sin, rope_first, interleave, heads_first)
    assert out.is_contiguous() and out.shape == ref.shape
    assert out.shape == ((b, h, s, nope + p) if heads_first else q.shape)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("interleave", [True, False], ids=["interleave", "rotate_half"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_kv_rope_in_one_launch_is_the_two_kernels(dtype, interleave, config):
    """One launch of both branches gives each branch's kernel's outputs bit for bit (its programs
    are theirs): query and k_pe equal the reference, the latent within its norm's two ulps."""
    r, p, h, nope = config
    g = torch.Generator().manual_seed(r + h)
    b, s = 2, 3
    q = torch.randn(b, s, h, nope + p, generator=g).to(DEVICE, dtype)
    kv = torch.randn(b, s, r + p, generator=g).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(r, generator=g)).to(DEVICE, dtype)
    cos, sin = _cos_sin((b, s), p // 2 if interleave else p, dtype, g)
    out = mla_q_kv_rope_triton(q, kv, weight, cos, sin, 1e-6, 0.0, True, interleave)
    separate = (
        mla_q_rope_triton(q, cos, sin, False, interleave, True),
        *mla_kv_norm_rope_triton(kv, weight, cos, sin, 1e-6, 0.0, True, interleave),
    )
    for one, two in zip(out, separate, strict=True):
        assert one.shape == two.shape and one.is_contiguous() and torch.equal(one, two)
    ref = mla_q_kv_rope_reference(q, kv, weight, cos, sin, 1e-6, 0.0, True, interleave)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[2], ref[2])
    assert _within_ulp(out[1], ref[1], dtype, ulps=2)


@pytest.mark.parametrize("dims", [(128, 64), (32, 16), (40, 8)], ids=str)
@pytest.mark.parametrize("interleave", [False, True], ids=["rotate_half", "interleave"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indexer_k_norm_rope(dtype, interleave, dims):
    d, p = dims
    g = torch.Generator().manual_seed(d)
    k = (3 * torch.randn(2, 5, d, generator=g) + 1).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE, dtype)
    bias = (0.1 * torch.randn(d, generator=g)).to(DEVICE, dtype)
    cos, sin = _cos_sin((2, 5), p // 2 if interleave else p, dtype, g)
    out = mla_indexer_k_norm_rope_triton(k, weight, bias, cos, sin, 1e-6, interleave)
    ref = mla_indexer_k_norm_rope_reference(k, weight, bias, cos, sin, 1e-6, interleave)
    assert out.shape == k.shape and out.is_contiguous()
    # The pass-through slice is the LayerNorm alone: within an ulp of x.dtype (another summation
    # order; values near 0 after the centring carry the row's absolute error, hence the atol).
    tol = ULP[dtype]
    torch.testing.assert_close(out[..., p:], ref[..., p:], rtol=tol, atol=2 * tol)
    # The rotated slice: RoPE of a LayerNorm output that may be an ulp off, then two roundings.
    torch.testing.assert_close(out[..., :p], ref[..., :p], rtol=4 * tol, atol=4 * tol)
    # And not the RoPE of anything else: the fp64 math of the whole path agrees within 8 ulps.
    y = torch.nn.functional.layer_norm(k.double(), (d,), weight.double(), bias.double(), 1e-6)
    exact = rope_reference(y[..., :p], cos.double(), sin.double(), interleave)
    torch.testing.assert_close(out[..., :p].double(), exact, rtol=8 * tol, atol=8 * tol)


def _indexer_k_inputs(b, s, d, p, t, dtype, interleave, seed):
    g = torch.Generator().manual_seed(seed)
    k = (3 * torch.randn(b, s, d, generator=g) + 1).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE, dtype)
    bias = (0.1 * torch.randn(d, generator=g)).to(DEVICE, dtype)
    cos, sin = _cos_sin((b, s), p // 2 if interleave else p, dtype, g)
    cache = torch.randn(b, t, d, generator=g).to(DEVICE, dtype)
    return k, weight, bias, cos, sin, cache


# (B, S, D, P, T, positions): a decode step at slot 9 (one position, 0-d), one at a [1] position,
# a 3-token step from slot 4 (consecutive slots from one value), and tokens at their own slots
POSITION_CASES = [(2, 1, 128, 64, 12, [9]), (3, 1, 32, 16, 5, 4), (1, 3, 40, 8, 9, 4), (2, 4, 32, 16, 11, [7, 0, 10, 3])]


@pytest.mark.parametrize("case", POSITION_CASES, ids=str)
@pytest.mark.parametrize("interleave", [False, True], ids=["rotate_half", "interleave"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indexer_k_into_the_cache_is_the_kernel_and_index_copy(dtype, interleave, case):
    """The cache variant writes exactly the plain kernel's rows at the slots (every other slot
    untouched), as index_copy would; the plain kernel is tested against the reference above."""
    b, s, d, p, t, positions = case
    k, weight, bias, cos, sin, cache = _indexer_k_inputs(b, s, d, p, t, dtype, interleave, seed=d + s)
    positions = torch.tensor(positions, device=DEVICE)
    out = mla_indexer_k_norm_rope_cache_triton(k, weight, bias, cos, sin, cache, positions, 1e-6, interleave)
    assert out.data_ptr() != cache.data_ptr()  # a dispatcher call is functional
    rows = mla_indexer_k_norm_rope_triton(k, weight, bias, cos, sin, 1e-6, interleave)
    slots = positions.reshape(-1) + (torch.arange(s, device=DEVICE) if positions.numel() == 1 else 0)
    assert torch.equal(out, cache.index_copy(1, slots, rows))
    ref = mla_indexer_k_norm_rope_cache_reference(k, weight, bias, cos, sin, cache, positions, 1e-6, interleave)
    torch.testing.assert_close(out, ref, rtol=4 * ULP[dtype], atol=4 * ULP[dtype])


def test_indexer_k_cache_in_place_when_inlined_and_slots_past_the_cache_unwritten():
    """Given wrap (Inductor's inlined launch), the cache itself is written and returned; a slot
    outside the cache writes nothing (no memory outside it), where torch's index_copy raises."""
    k, weight, bias, cos, sin, cache = _indexer_k_inputs(2, 2, 32, 16, 6, torch.float32, False, seed=5)
    before = cache.clone()
    out = mla_indexer_k_norm_rope_cache_triton(k, weight, bias, cos, sin, cache, torch.tensor(2), 1e-6,
                                               wrap=lambda kernel: kernel)  # fmt: skip
    assert out is cache and not torch.equal(cache, before)
    assert torch.equal(cache[:, [0, 1, 4, 5]], before[:, [0, 1, 4, 5]])
    out = mla_indexer_k_norm_rope_cache_triton(k, weight, bias, cos, sin, before, torch.tensor([5, 6]), 1e-6)
    rows = mla_indexer_k_norm_rope_triton(k, weight, bias, cos, sin, 1e-6)
    assert torch.equal(out[:, 5], rows[:, 0]) and torch.equal(out[:, :5], before[:, :5])
    with pytest.raises(IndexError):
        mla_indexer_k_norm_rope_cache_reference(k, weight, bias, cos, sin, before, torch.tensor([5, 6]), 1e-6)


@pytest.mark.parametrize(
    "case",
    [("cache", lambda c: c.to(torch.float16), "cache [2, T, 32] torch.float32 expected"),
     ("cache", lambda c: c[:1], "cache [2, T, 32]"),
     ("positions", lambda p: p.float(), "positions must be 2 or 1 int64 / int32 values"),
     ("positions", lambda p: torch.tensor([1, 2, 3]), "positions must be 2 or 1")],  # fmt: skip
    ids=["dtype", "batch", "float positions", "three positions"],
)
def test_indexer_k_cache_bad_arguments_raise(case):
    what, change, message = case
    k, weight, bias, cos, sin, cache = _indexer_k_inputs(2, 2, 32, 16, 6, torch.float32, False, seed=1)
    args = {"cache": cache, "positions": torch.tensor([0, 1])}
    args[what] = change(args[what])
    with pytest.raises(ValueError, match=re.escape(message)):
        mla_indexer_k_norm_rope_cache(k, weight, bias, cos, sin, args["cache"], args["positions"], 1e-6)


def _kv_write_inputs(b, h, s, nope, r, v, t, dtype, seed, shared_pe=True):
    """k_nope and value as transformers' expand_kv makes them: splits of kv_b_proj's output
    viewed [B, S, H, NOPE + V] and transposed (strided views), k_pe [B, 1, S, R]."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(b, s, h * (nope + v), generator=g).to(DEVICE, dtype)
    k_nope, value = kv.view(b, s, h, nope + v).transpose(1, 2).split([nope, v], dim=-1)
    k_pe = torch.randn(b, 1 if shared_pe else h, s, r, generator=g).to(DEVICE, dtype)
    k_cache = torch.randn(b, h, t, nope + r, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(b, h, t, v, generator=g).to(DEVICE, dtype)
    return k_nope, k_pe, value, k_cache, v_cache


# (B, H, S, NOPE, R, V, T, positions, k_pe shared): DeepSeek V3.2's widths at a decode step, a
# 3-token step from slot 4, odd widths with a slot per token, k_pe per head
KV_WRITE_CASES = [(1, 4, 1, 128, 64, 128, 9, [5], True), (2, 3, 3, 32, 16, 24, 11, 4, True),
                  (2, 2, 4, 20, 8, 12, 10, [9, 0, 3, 6], True), (1, 5, 2, 16, 8, 16, 6, [1, 4], False)]  # fmt: skip


@pytest.mark.parametrize("case", KV_WRITE_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mla_kv_cache_write_is_the_reference(dtype, case):
    """A copy: the caches bit-equal the reference's (index_copy of cat(k_nope, k_pe) and value)."""
    b, h, s, nope, r, v, t, positions, shared = case
    args = _kv_write_inputs(b, h, s, nope, r, v, t, dtype, seed=nope + s, shared_pe=shared)
    positions = torch.tensor(positions, device=DEVICE)
    k_out, v_out = mla_kv_cache_write_triton(*args, positions)
    k_ref, v_ref = mla_kv_cache_write_reference(*args, positions)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    assert not torch.equal(k_out, args[3])  # something was written (and the inputs left alone)


def test_mla_kv_cache_write_in_place_when_inlined_and_slots_past_the_cache_unwritten():
    k_nope, k_pe, value, k_cache, v_cache = _kv_write_inputs(1, 2, 2, 16, 8, 16, 5, torch.float32, seed=3)
    before = (k_cache.clone(), v_cache.clone())
    out = mla_kv_cache_write_triton(k_nope, k_pe, value, k_cache, v_cache, torch.tensor(1), wrap=lambda f: f)
    assert out[0] is k_cache and out[1] is v_cache
    ref = mla_kv_cache_write_reference(k_nope, k_pe, value, *before, torch.tensor(1))
    assert torch.equal(k_cache, ref[0]) and torch.equal(v_cache, ref[1])
    k_out, v_out = mla_kv_cache_write_triton(k_nope, k_pe, value, *before, torch.tensor([4, 5]))
    assert torch.equal(k_out[:, :, :4], before[0][:, :, :4]) and torch.equal(v_out[:, :, :4], before[1][:, :, :4])
    assert torch.equal(v_out[:, :, 4], value[:, :, 0])


@pytest.mark.parametrize(
    "change,message",
    [(lambda a: {**a, "v_cache": a["v_cache"][:, :, :3]}, "the caches hold 5 and 3 slots"),
     (lambda a: {**a, "k_cache": a["k_cache"][..., :-1]}, "k_cache [1, 2, T, 24] torch.float32 expected"),
     (lambda a: {**a, "value": a["value"].to(torch.float16)}, "value is torch.float16"),
     (lambda a: {**a, "positions": torch.tensor([1, 2, 3])}, "positions must be 2 or 1")],  # fmt: skip
    ids=["slots", "key width", "dtype", "positions"],
)
def test_mla_kv_cache_write_bad_arguments_raise(change, message):
    names = ("k_nope", "k_pe", "value", "k_cache", "v_cache")
    args = dict(zip(names, _kv_write_inputs(1, 2, 2, 16, 8, 16, 5, torch.float32, seed=4)))
    args = change({**args, "positions": torch.tensor(0)})
    with pytest.raises(ValueError, match=re.escape(message)):
        mla_kv_cache_write(*args.values())


# (B, S, H, D, P, cache slots or None, positions): a decode step with and without the cache, a
# 3-token step from slot 4, odd widths at a slot per token
INDEXER_QK_CASES = [(2, 1, 4, 128, 64, None, None), (1, 1, 3, 128, 64, 12, [9]), (2, 3, 5, 32, 16, 11, 4),
                    (1, 2, 3, 40, 8, 6, [5, 0])]  # fmt: skip


@pytest.mark.parametrize("case", INDEXER_QK_CASES, ids=str)
@pytest.mark.parametrize("interleave", [False, True], ids=["rotate_half", "interleave"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indexer_q_and_k_in_one_launch_are_the_two_kernels(dtype, interleave, case):
    """The merged launch's query and key (or cache) bit-equal the two kernels' (each tested
    against its reference above), and the reference's within their bounds."""
    b, s, h, d, p, slots, positions = case
    k, weight, bias, cos, sin, cache = _indexer_k_inputs(b, s, d, p, slots or 1, dtype, interleave, seed=h + d)
    q = torch.randn(b, s, h * d, generator=torch.Generator().manual_seed(s)).to(DEVICE, dtype).view(b, s, h, d)
    cache = None if slots is None else cache
    positions = None if positions is None else torch.tensor(positions, device=DEVICE)
    query, keys = mla_indexer_qk_rope_triton(q, k, weight, bias, cos, sin, cache, positions, 1e-6, interleave)
    assert torch.equal(query, mla_q_rope_triton(q, cos, sin, True, interleave, False))
    if cache is None:
        assert torch.equal(keys, mla_indexer_k_norm_rope_triton(k, weight, bias, cos, sin, 1e-6, interleave))
    else:
        assert keys.data_ptr() != cache.data_ptr()
        expected = mla_indexer_k_norm_rope_cache_triton(k, weight, bias, cos, sin, cache, positions, 1e-6, interleave)
        assert torch.equal(keys, expected)
    ref = mla_indexer_qk_rope_reference(q, k, weight, bias, cos, sin, cache, positions, 1e-6, interleave)
    assert torch.equal(query, ref[0])  # RoPE alone: bit-exact
    torch.testing.assert_close(keys, ref[1], rtol=4 * ULP[dtype], atol=4 * ULP[dtype])


def _indexer_and_kv_inputs(dtype, case, kv_case):
    """The indexer's inputs (into its cache) of INDEXER_QK_CASES' case and the KV write's of
    KV_WRITE_CASES' kv_case (the indexer's batch), positions on the device."""
    b, s, h, d, p, slots, positions = case
    k, weight, bias, cos, sin, cache = _indexer_k_inputs(b, s, d, p, slots, dtype, False, seed=h + d)
    q = torch.randn(b, s, h * d, generator=torch.Generator().manual_seed(s)).to(DEVICE, dtype).view(b, s, h, d)
    _, kh, ks, nope, r, v, t, kv_positions, shared = kv_case
    kv = _kv_write_inputs(b, kh, ks, nope, r, v, t, dtype, seed=nope + ks, shared_pe=shared)
    return (q, k, weight, bias, cos, sin, cache, torch.tensor(positions, device=DEVICE), kv,
            torch.tensor(kv_positions, device=DEVICE))  # fmt: skip


@pytest.mark.parametrize("kv_case", [KV_WRITE_CASES[0], KV_WRITE_CASES[2]], ids=["decode", "slot_per_token"])
@pytest.mark.parametrize("case", [c for c in INDEXER_QK_CASES if c[5] is not None], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indexer_and_kv_cache_writes_in_one_launch_are_the_kernels(dtype, case, kv_case):
    """mla_indexer_qk_rope_kv_cache: the indexer's merged launch (into its cache) and the KV cache
    write in one launch, each cache at its own positions: bit-equal to the two launches, in place
    when inlined."""
    from fusion_passes.lowering.mla_rope.reference import mla_indexer_qk_rope_kv_cache_reference
    from fusion_passes.lowering.mla_rope.triton import mla_indexer_qk_rope_kv_cache_triton

    q, k, weight, bias, cos, sin, cache, positions, kv, kv_positions = _indexer_and_kv_inputs(dtype, case, kv_case)
    args = (q, k, weight, bias, cos, sin, cache, positions, *kv, kv_positions, 1e-6)
    query, keys, k_out, v_out = mla_indexer_qk_rope_kv_cache_triton(*args)
    two = mla_indexer_qk_rope_triton(q, k, weight, bias, cos, sin, cache, positions, 1e-6)
    kv_two = mla_kv_cache_write_triton(*kv, kv_positions)
    assert all(torch.equal(a, e) for a, e in zip((query, keys, k_out, v_out), (*two, *kv_two), strict=True))
    ref = mla_indexer_qk_rope_kv_cache_reference(*args)
    assert torch.equal(k_out, ref[2]) and torch.equal(v_out, ref[3]) and torch.equal(query, ref[0])
    inputs = [t.clone() for t in (cache, kv[3], kv[4])]  # in place, as Inductor launches it
    out = mla_indexer_qk_rope_kv_cache_triton(q, k, weight, bias, cos, sin, inputs[0], positions, *kv[:3], inputs[1],
                                              inputs[2], kv_positions, 1e-6, wrap=lambda f: f)  # fmt: skip
    assert all(o is i for o, i in zip(out[1:], inputs)) and all(torch.equal(a, e) for a, e in zip(inputs, (keys, k_out, v_out)))


@pytest.mark.parametrize(
    "cache,positions,message",
    [(True, None, "a cache without positions"), (False, torch.tensor(1), "positions without a cache")],
)
def test_indexer_qk_bad_arguments_raise(cache, positions, message):
    k, weight, bias, cos, sin, kcache = _indexer_k_inputs(2, 2, 32, 16, 6, torch.float32, False, seed=1)
    q = torch.randn(2, 2, 3, 32, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        mla_indexer_qk_rope(q, k, weight, bias, cos, sin, kcache if cache else None, positions, 1e-6)
    with pytest.raises(ValueError, match=re.escape("q [B, S, H, D] and k [B, S, D] of one dtype expected")):
        mla_indexer_qk_rope(q[..., :16].contiguous(), k, weight, bias, cos, sin, None, None, 1e-6)  # another head dim


def test_ops_opcheck_and_dispatch():
    """Schemas, fakes (shapes, strides) and dispatch checked by opcheck; outputs are the reference's."""
    g = torch.Generator().manual_seed(3)
    dt = torch.bfloat16
    kv = torch.randn(2, 3, 48, generator=g).to(DEVICE, dt)
    w = torch.randn(32, generator=g).to(DEVICE, dt)
    cos, sin = _cos_sin((2, 3), 8, dt, g)
    q = torch.randn(2, 3, 4, 24, generator=g).to(DEVICE, dt)
    k = torch.randn(2, 3, 24, generator=g).to(DEVICE, dt)
    b = torch.randn(24, generator=g).to(DEVICE, dt)
    torch.library.opcheck(mla_kv_norm_rope, (kv, w, cos, sin, 1e-6, 0.0, True, True))
    torch.library.opcheck(mla_q_kv_rope, (q, kv, w, cos, sin, 1e-6, 0.0, True, True))
    for flags in [(False, True, True), (True, False, False)]:
        torch.library.opcheck(mla_q_rope, (q, cos, sin, *flags))
    k_cos, k_sin = _cos_sin((2, 3), 16, dt, g)
    torch.library.opcheck(mla_indexer_k_norm_rope, (k, w[:24].clone().fill_(1), b, k_cos, k_sin, 1e-6, False))
    cache = torch.randn(2, 7, 24, generator=g).to(DEVICE, dt)
    for positions in (torch.tensor(3), torch.tensor([6, 0, 2])):
        args = (k, w[:24].clone().fill_(1), b, k_cos, k_sin, cache, positions.to(DEVICE), 1e-6, False)
        torch.library.opcheck(mla_indexer_k_norm_rope_cache, args)
    iq = torch.randn(2, 3, 4, 24, generator=g).to(DEVICE, dt)
    for cache_args in ((None, None), (torch.randn(2, 7, 24, generator=g).to(DEVICE, dt), torch.tensor(3).to(DEVICE))):
        qk_args = (iq, k, w[:24].clone().fill_(1), b, k_cos, k_sin, *cache_args, 1e-6, False)
        torch.library.opcheck(mla_indexer_qk_rope, qk_args)
    kv_args = _kv_write_inputs(2, 3, 2, 16, 8, 12, 6, dt, seed=7)
    for positions in (torch.tensor(2), torch.tensor([5, 1])):
        torch.library.opcheck(mla_kv_cache_write, (*kv_args, positions.to(DEVICE)))
    out = mla_q_rope(q, cos, sin, False, True, True)
    assert torch.equal(out, mla_q_rope_reference(q, cos, sin, False, True, True))


@pytest.mark.parametrize(
    "case",
    ["cos_sin_shapes_differ", "cos_dtype", "odd_rope", "weight_width", "cos_not_broadcastable"],
)
def test_bad_arguments_raise(case):
    kv = torch.randn(2, 3, 48).to(DEVICE)
    w = torch.randn(32).to(DEVICE)
    cos = sin = torch.randn(2, 3, 8).to(DEVICE)
    if case == "cos_sin_shapes_differ":
        sin = torch.randn(2, 1, 8).to(DEVICE)
    elif case == "cos_dtype":
        cos = cos.half()
    elif case == "odd_rope":
        cos = sin = torch.randn(2, 3, 7).to(DEVICE)
        kv, w = torch.randn(2, 3, 39).to(DEVICE), torch.randn(32).to(DEVICE)
    elif case == "weight_width":
        w = torch.randn(31).to(DEVICE)
    else:
        cos = sin = torch.randn(2, 2, 8).to(DEVICE)
    for call in (mla_kv_norm_rope_triton, mla_kv_norm_rope_reference):
        with pytest.raises(ValueError) as raised:
            call(kv, w, cos, sin, 1e-6, 0.0, True, True)
        assert "\n" not in str(raised.value)


def test_q_and_kv_of_other_tokens_raise():
    """mla_q_kv_rope shares cos/sin between q and kv: both must be of the same tokens and dtype."""
    kv, w = torch.randn(2, 3, 48).to(DEVICE), torch.randn(32).to(DEVICE)
    cos = sin = torch.randn(2, 3, 8).to(DEVICE)
    for q in (torch.randn(2, 4, 2, 24).to(DEVICE), torch.randn(2, 3, 2, 24).to(DEVICE, torch.float16)):
        for call in (mla_q_kv_rope_triton, mla_q_kv_rope_reference):
            with pytest.raises(ValueError) as raised:
                call(q, kv, w, cos, sin, 1e-6, 0.0, True, True)
            assert "\n" not in str(raised.value)


_TRACE_ONE_LAUNCH = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from fusion_passes.lowering.mla_rope.triton import mla_q_kv_rope_triton

with FakeTensorMode():
    q = torch.empty(1, 3, 4, 24, dtype=torch.bfloat16, device="cuda")
    kv = torch.empty(1, 3, 48, dtype=torch.bfloat16, device="cuda")
    w = torch.empty(32, dtype=torch.bfloat16, device="cuda")
    cos = torch.empty(1, 3, 8, dtype=torch.bfloat16, device="cuda")
launch = lambda *a: mla_q_kv_rope_triton(*a, 1e-6, 0.0, True, True, wrap=torch.library.wrap_triton)
graph = make_fx(launch, tracing_mode="fake")(q, kv, w, cos, cos).graph
launches = [n for n in graph.nodes if "triton_kernel_wrapper" in str(n.target)]
print(len(launches), launches[0].kwargs["grid"])
"""


def test_q_kv_rope_traces_to_one_launch_for_inductor():
    """The launcher as Inductor inlines it on CUDA (wrap_triton, fake CUDA tensors: no GPU needed,
    but compiled Triton, hence a process without the interpreter): one kernel launch, of the kv
    program (16 rows of width 48) and 3 tokens x 1 block of 4 heads."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _TRACE_ONE_LAUNCH], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "1 [(4, 1, 1)]"


@pytest.mark.parametrize("x_width", [1536, 40])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleave", "rotate_half"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_a_norm_and_kv_branch_in_one_launch(dtype, interleave, x_width):
    """mla_q_a_kv_norm_rope: the kv branch bit-equal to mla_kv_norm_rope's kernel, q_a's norm rows
    (the kv branch's norm, no rope part) bit-equal to that kernel's latent for the same rows, and
    within two ulps of the canonical rms_norm's reference, in both weight forms."""
    from fusion_passes.lowering.mla_rope.reference import mla_q_a_kv_norm_rope_reference
    from fusion_passes.lowering.mla_rope.triton import mla_q_a_kv_norm_rope_triton

    r, p, b, s = 512, 64, 2, 3
    g = torch.Generator().manual_seed(x_width)
    kv = torch.randn(b, s, r + p, generator=g).to(DEVICE, dtype)
    x = (2 * torch.randn(b, s, x_width, generator=g)).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(r, generator=g)).to(DEVICE, dtype)
    x_weight = (1 + 0.1 * torch.randn(x_width, generator=g)).to(DEVICE, dtype)
    cos, sin = _cos_sin((b, s), p // 2 if interleave else p, dtype, g)
    for offset, cast in ((0.0, True), (1.0, False)):  # Llama's form; (1 + w) after the weight
        out = mla_q_a_kv_norm_rope_triton(x, x_weight, 1e-6, offset, cast, kv, weight, cos, sin, 1e-6, 0.0, True,
                                          interleave)  # fmt: skip
        kv_alone = mla_kv_norm_rope_triton(kv, weight, cos, sin, 1e-6, 0.0, True, interleave)
        assert torch.equal(out[1], kv_alone[0]) and torch.equal(out[2], kv_alone[1])
        x_as_kv = torch.cat([x, kv[..., r:]], dim=-1)  # the same norm rows, through the kv kernel
        assert torch.equal(out[0], mla_kv_norm_rope_triton(x_as_kv, x_weight, cos, sin, 1e-6, offset, cast, interleave)[0])
        ref = mla_q_a_kv_norm_rope_reference(x, x_weight, 1e-6, offset, cast, kv, weight, cos, sin, 1e-6, 0.0, True,
                                             interleave)  # fmt: skip
        torch.testing.assert_close(out[0], ref[0], rtol=2 * ULP[dtype], atol=2 * ULP[dtype])


@pytest.mark.parametrize("kv_case", [KV_WRITE_CASES[0], KV_WRITE_CASES[2]], ids=["decode", "slot_per_token"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mla_query_indexer_and_kv_cache_writes_in_one_launch_are_the_kernels(dtype, kv_case):
    """mla_q_indexer_kv_cache: MLA's query RoPE (rope last, heads first) with the indexer's launch
    and the KV write: every output bit-equal to the separate kernels', in place when inlined."""
    from fusion_passes.lowering.mla_rope.reference import mla_q_indexer_kv_cache_reference
    from fusion_passes.lowering.mla_rope.triton import mla_indexer_qk_rope_kv_cache_triton, mla_q_indexer_kv_cache_triton

    q, k, weight, bias, cos, sin, cache, positions, kv, kv_positions = _indexer_and_kv_inputs(
        dtype, INDEXER_QK_CASES[1], kv_case
    )
    b, s = k.shape[:2]
    g = torch.Generator().manual_seed(7)
    mq = torch.randn(b, s, 5, 48 + 32, generator=g).to(DEVICE, dtype)
    mcos, msin = _cos_sin((b, s), 16, dtype, g)  # MLA's interleaved rope of 32
    indexer = (q, k, weight, bias, cos, sin, cache, positions, *kv, kv_positions, 1e-6)
    out = mla_q_indexer_kv_cache_triton(mq, mcos, msin, True, *indexer)
    separate = (mla_q_rope_triton(mq, mcos, msin, False, True, True), *mla_indexer_qk_rope_kv_cache_triton(*indexer))
    assert all(torch.equal(a, e) for a, e in zip(out, separate, strict=True))
    ref = mla_q_indexer_kv_cache_reference(mq, mcos, msin, True, *indexer)
    # RoPE and the cache copies alone: bit-exact; the indexer key's LayerNorm within its bounds
    assert all(torch.equal(out[i], ref[i]) for i in (0, 1, 3, 4))
    torch.testing.assert_close(out[2], ref[2], rtol=4 * ULP[dtype], atol=4 * ULP[dtype])
    inputs = [t.clone() for t in (cache, kv[3], kv[4])]
    placed = mla_q_indexer_kv_cache_triton(mq, mcos, msin, True, q, k, weight, bias, cos, sin, inputs[0], positions,
                                           *kv[:3], inputs[1], inputs[2], kv_positions, 1e-6, wrap=lambda f: f)  # fmt: skip
    assert all(o is i for o, i in zip(placed[2:], inputs)) and all(torch.equal(a, e) for a, e in zip(placed, separate))
