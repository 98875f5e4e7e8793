"""The Triton QK-norm + RoPE kernel against the plain-torch reference: on CPU tensors through
Triton's interpreter, or on CUDA tensors, compiled, where a GPU is present.

fp32 within 1e-5 (the kernel sums the squares in another order). bf16/fp16: the output passes
through four roundings (the norm, two RoPE products, their sum); the interpreter truncates instead
of rounding to nearest, so each may be one ulp off: within 4 ulps of the row's largest value.
"""

import os

import torch  # torch does not import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import pytest  # noqa: E402
from _hypothesis import examples  # noqa: E402
from _params import by_str, grid  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fusion_passes.lowering.qk_norm_rope.op import qk_norm_rope, qk_norm_rope_cache  # noqa: E402
from fusion_passes.lowering.qk_norm_rope.reference import (  # noqa: E402
    qk_norm_rope_cache_reference,
    qk_norm_rope_reference,
)
from fusion_passes.lowering.qk_norm_rope.triton import (  # noqa: E402
    SPLIT_MAX_STEPS,
    WHOLE_ROW_WIDE_MAX_TOKENS,
    qk_norm_rope_cache_triton,
    qk_norm_rope_triton,
    whole_row_step_rows,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FORMS = {"llama": (0.0, True), "fp32_weight": (0.0, False), "offset": (1.0, False)}
# (q heads, kv heads, head dim, rotary dim, norm per head): each model's shape at small widths,
# and odd sizes (head dims and rotary halves that are not powers of two).
CONFIGS = {
    "qwen3": (4, 2, 32, 32, True),  # full RoPE
    "qwen3_5": (3, 1, 64, 16, True),  # partial_rotary_factor 0.25
    "minimax_m2": (6, 2, 32, 16, False),  # whole-row norm, rotary half the head
    "odd": (5, 3, 24, 10, True),  # half 5, pass-through 14
    "odd_whole_row": (3, 1, 20, 6, False),
    "tiny_rotary": (2, 2, 8, 2, True),
}
ULPS = 4
TILES = {"split_tiles": False, "whole_head_tile": True}


def _inputs(config, dtype, form, tokens=(2, 3), seed=0, q_chunk=False, cos_batch=1, interleaved=False,
            cos_dtype=None):  # fmt: skip
    hq, hk, d, r, per_head = config
    b, s = tokens
    g = torch.Generator().manual_seed(seed)
    # q as Qwen 3.5 takes it: the first half of each head of the q+gate projection (strided).
    q = torch.randn(b, s, hq, 2 * d if q_chunk else d, generator=g)
    k = torch.randn(b, s, hk, d, generator=g)
    offset = FORMS[form][0]
    wq = offset + 0.3 * torch.randn(d if per_head else hq * d, generator=g)
    wk = offset + 0.3 * torch.randn(d if per_head else hk * d, generator=g)
    angles = 100 * torch.rand(cos_batch, s, r // 2, generator=g)
    if interleaved:  # GLM's repeat_interleave(2): one angle per pair (2j, 2j + 1)
        angles = angles.repeat_interleave(2, dim=-1)
    else:  # transformers' cat((freqs, freqs))
        angles = torch.cat((angles, angles), dim=-1)
    w_dtype = dtype if FORMS[form][1] else torch.float32
    cos_dtype = cos_dtype or dtype  # float32: the RoPE in fp32 (Olmo2, gpt-fast)
    return (
        q.to(DEVICE, dtype)[..., :d], k.to(DEVICE, dtype), wq.to(DEVICE, w_dtype), wk.to(DEVICE, w_dtype),
        angles.cos().to(DEVICE, cos_dtype), angles.sin().to(DEVICE, cos_dtype),
    )  # fmt: skip


def _assert_close(actual, expected, dtype):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert actual.stride() == expected.stride()
    a, e = actual.double(), expected.double()
    if dtype == torch.float32:
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
        return
    scale = e.abs().amax(-1, keepdim=True).clamp(min=1.0)
    bound = ULPS * torch.finfo(dtype).eps * scale
    assert torch.all((a - e).abs() <= bound), float(((a - e).abs() / scale).max())


def _check(args, eps, form, per_head, dtype, whole_head_tile=None, rows=None, interleaved=False):
    offset, cast = FORMS[form]
    outs = qk_norm_rope_triton(*args, eps, offset, cast, per_head, interleaved,
                               whole_head_tile=whole_head_tile, rows=rows)  # fmt: skip
    refs = qk_norm_rope_reference(*args, eps, offset, cast, per_head, interleaved)
    for out, ref in zip(outs, refs, strict=True):
        assert not out.isnan().any()
        _assert_close(out, ref, dtype)


# Under the interpreter by default every config in one dtype (each dtype for two of them), both
# row bodies; the rest is marked slow. On a GPU every case runs by default.
@pytest.mark.parametrize(
    ("config", "dtype", "tile"),
    grid(
        {"config": by_str(list(CONFIGS)), "dtype": by_str(DTYPES), "tile": TILES},
        default=lambda config, dtype, tile: (
            DEVICE == "cuda" or DTYPES.index(dtype) == list(CONFIGS).index(config) % 3
        ),
    ),
)
def test_kernel_matches_reference(config, dtype, tile):
    """Both row bodies of the kernel (three column tiles per head, or one whole-head tile)."""
    per_head = CONFIGS[config][4]
    for i, form in enumerate(FORMS):
        args = _inputs(CONFIGS[config], dtype, form, seed=i)
        _check(args, [1e-6, 1e-5, 0.1][i], form, per_head, dtype, tile)


# Under the interpreter by default every config, step and body (the refusal of too many steps
# included) in one dtype; the rest is marked slow. On a GPU every case runs by default.
@pytest.mark.parametrize(
    ("config", "dtype", "rows", "tile"),
    grid(
        {
            "config": by_str(["minimax_m2", "odd_whole_row"]),
            "dtype": by_str(DTYPES),
            "rows": by_str([1, 2, 4]),
            "tile": TILES,
        },
        default=lambda config, dtype, rows, tile: (
            DEVICE == "cuda" or DTYPES.index(dtype) == ([1, 2, 4].index(rows) + tile) % 3
        ),
    ),
)
def test_whole_row_norm_in_steps(config, dtype, rows, tile):
    """Both row bodies take a whole-row norm's heads `rows` at a time (6 heads of q in 6, 3 or 2
    steps, the last one part-masked where rows does not divide the heads; 2 of k, 3 or 1 of
    odd's): the sum of squares over every step, then the outputs of each. The split tiles hold
    every step at once, at most SPLIT_MAX_STEPS of them: more is refused."""
    hq = CONFIGS[config][0]  # more heads than k in both configs
    for i, form in enumerate(FORMS):
        args = _inputs(CONFIGS[config], dtype, form, seed=10 + i, q_chunk=i == 2)
        if not tile and -(-hq // rows) > SPLIT_MAX_STEPS:
            with pytest.raises(ValueError, match="at most 4 steps"):
                _check(args, 1e-6, form, False, dtype, tile, rows)
            return
        _check(args, [1e-6, 1e-5, 0.1][i], form, False, dtype, tile, rows)


def test_whole_row_default_launch_in_steps():
    """Above WHOLE_ROW_WIDE_MAX_TOKENS static tokens (and for a dynamic count) a whole-row norm
    takes the split tiles in steps of whole_row_step_rows heads: 20 q heads in 2 steps of 16 (k's
    4 in one), and one step of 32, against the reference."""
    assert [whole_row_step_rows(h) for h in (48, 96, 8, 20, 200)] == [16, 32, 8, 16, 64]
    config = (20, 4, 8, 4, False)
    for tokens in ((1, WHOLE_ROW_WIDE_MAX_TOKENS + 1), (2, 3)):
        args = _inputs(config, torch.bfloat16, "llama", tokens, seed=3, q_chunk=True)
        _check(args, 1e-6, "llama", False, torch.bfloat16)
        _check(args, 1e-6, "llama", False, torch.bfloat16, rows=32)


@pytest.mark.parametrize("tile", [False, True], ids=["split_tiles", "whole_head_tile"])
@pytest.mark.parametrize("config", ["qwen3_5", "minimax_m2"])
def test_strided_q_batched_cos_and_one_token(config, tile):
    """Qwen 3.5's strided q, cos/sin per sequence (batch 3), and a decode step of one token."""
    per_head = CONFIGS[config][4]
    for tokens, cos_batch in (((3, 5), 3), ((1, 1), 1), ((4, 1), 1)):
        args = _inputs(CONFIGS[config], torch.bfloat16, "offset", tokens, q_chunk=True,
                       cos_batch=cos_batch)  # fmt: skip
        assert args[0].stride(-2) == 2 * args[0].shape[-1]
        _check(args, 1e-6, "offset", per_head, torch.bfloat16, tile)


# GPT-J pairs (GLM, gpt-fast, vLLM is_neox_style=False) and the fp32 RoPE (Olmo2's fp32 cos / sin,
# gpt-fast's fp32 math): under the interpreter by default one case of each body and norm scope.
ROPE_FORMS = {"interleaved": (True, None), "fp32": (False, torch.float32), "interleaved_fp32": (True, torch.float32)}
_ROPE_DEFAULT = {("qwen3", "interleaved", False), ("odd_whole_row", "interleaved", True),
                 ("qwen3_5", "fp32", True), ("minimax_m2", "interleaved_fp32", False)}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "rope", "tile"),
    grid(
        {"config": by_str(list(CONFIGS)), "rope": by_str(list(ROPE_FORMS)), "tile": TILES},
        default=lambda config, rope, tile: DEVICE == "cuda" or (config, rope, tile) in _ROPE_DEFAULT,
    ),
)
def test_interleaved_and_fp32_rope(config, rope, tile):
    """Both row bodies with GPT-J pairs (the pair's elements at 2j, 2j + 1: strided loads and
    stores in the split tiles, the neighbour as partner in the whole-head tile) and with the RoPE
    in fp32 (products not rounded to the activations' dtype)."""
    interleaved, cos_dtype = ROPE_FORMS[rope]
    per_head = CONFIGS[config][4]
    for i, form in enumerate(FORMS):
        args = _inputs(CONFIGS[config], torch.bfloat16, form, seed=20 + i, q_chunk=i == 1,
                       interleaved=interleaved, cos_dtype=cos_dtype)  # fmt: skip
        _check(args, 1e-6, form, per_head, torch.bfloat16, tile, interleaved=interleaved)


@st.composite
def _shapes(draw):
    """Any head counts, head dim and rotary dim the op allows (R even, 2 <= R <= D), either norm
    scope, each body and launch override, a strided q, cos per sequence or broadcast."""
    d = draw(st.integers(1, 24)) * 2
    per_head = draw(st.booleans())
    hq, hk = draw(st.integers(1, 9)), draw(st.integers(1, 5))
    tile = draw(st.sampled_from([None, False, True]))  # None: the split tiles at these token counts
    # The split tiles' whole-row norm takes at most SPLIT_MAX_STEPS steps of `rows` heads.
    split_steps_ok = [r for r in (1, 2, 4, 8) if -(-max(hq, hk) // r) <= SPLIT_MAX_STEPS]
    rows_options = (1, 2, 4, 8) if per_head or tile else split_steps_ok
    return dict(
        config=(hq, hk, d, 2 * draw(st.integers(1, d // 2)), per_head),
        dtype=draw(st.sampled_from(DTYPES)),
        form=draw(st.sampled_from(list(FORMS))),
        tokens=(draw(st.integers(1, 3)), draw(st.integers(1, 5))),
        q_chunk=draw(st.booleans()),
        per_sequence_cos=draw(st.booleans()),
        tile=tile,
        rows=draw(st.sampled_from([None, *rows_options])),
        seed=draw(st.integers(0, 2**31 - 1)),
        interleaved=draw(st.booleans()),
        cos_fp32=draw(st.booleans()),
    )


@settings(max_examples=examples(40), deadline=None)
@given(case=_shapes())
def test_any_head_configuration(case):
    """Property: every head configuration, body and launch shape matches the reference."""
    cos_batch = case["tokens"][0] if case["per_sequence_cos"] else 1
    args = _inputs(case["config"], case["dtype"], case["form"], case["tokens"], case["seed"], case["q_chunk"],
                   cos_batch, case["interleaved"], torch.float32 if case["cos_fp32"] else None)  # fmt: skip
    _check(args, 1e-6, case["form"], case["config"][4], case["dtype"], case["tile"], case["rows"],
           case["interleaved"])  # fmt: skip


def test_rotation_is_applied_per_position():
    """Positions differ per token: swapping two tokens' cos/sin must change the output (the kernel
    does not read one position for all tokens), and the pass-through dims stay as normed."""
    q, k, wq, wk, cos, sin = _inputs(CONFIGS["qwen3_5"], torch.float32, "llama", (1, 4))
    out_q, _ = qk_norm_rope_triton(q, k, wq, wk, cos, sin, 1e-6, 0.0, True, True)
    swapped = [1, 0, 2, 3]
    out_q2, _ = qk_norm_rope_triton(q, k, wq, wk, cos[:, swapped], sin[:, swapped], 1e-6, 0.0, True)
    r = cos.shape[-1]
    assert not torch.allclose(out_q[:, :, :2, :r], out_q2[:, :, :2, :r])
    torch.testing.assert_close(out_q[..., r:], out_q2[..., r:], rtol=0, atol=0)
    torch.testing.assert_close(out_q[:, :, 2:], out_q2[:, :, 2:], rtol=0, atol=0)


def test_outputs_fully_written(monkeypatch):
    """Outputs allocated NaN-filled come back NaN-free (every row and column stored)."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    for config in ("odd", "odd_whole_row", "minimax_m2"):
        for tile, rows in ((False, None), (True, None), (True, 4)):
            args = _inputs(CONFIGS[config], torch.float16, "llama", (3, 7), q_chunk=True)
            outs = qk_norm_rope_triton(*args, 1e-6, 0.0, True, CONFIGS[config][4], whole_head_tile=tile,
                                       rows=rows)  # fmt: skip
            assert not any(o.isnan().any() for o in outs)


def test_op_matches_reference_and_fake():
    """The custom op: schema, fake (shapes, dtypes, the transposed strides) and dispatch checked by
    opcheck; on DEVICE it returns the reference's outputs (CPU) or the kernel's (CUDA)."""
    for config, form, interleaved in (("qwen3", "llama", False), ("minimax_m2", "llama", True),
                                      ("qwen3_5", "offset", False)):  # fmt: skip
        per_head = CONFIGS[config][4]
        offset, cast = FORMS[form]
        args = _inputs(CONFIGS[config], torch.bfloat16, form, q_chunk=True, interleaved=interleaved)
        full = (*args, 1e-6, offset, cast, per_head, interleaved)
        torch.library.opcheck(qk_norm_rope, full)
        for out, ref in zip(qk_norm_rope(*full), qk_norm_rope_reference(*full), strict=True):
            _assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize(
    "change",
    [
        "cos_fp16",  # neither q's dtype nor fp32
        "sin_shape",  # sin differs from cos
        "cos_tokens",  # cos for another number of tokens
        "cos_odd",  # odd rotary dim
        "cos_wide",  # rotary dim above the head dim
        "weight_width",  # per-head norm given a whole-row weight
        "k_head_dim",  # k's head dim differs from q's
        "llama_fp32_weight",  # the Llama form with an fp32 weight
    ],
)
def test_bad_arguments_raise(change):
    q, k, wq, wk, cos, sin = _inputs(CONFIGS["qwen3"], torch.bfloat16, "llama")
    cast = True
    if change == "cos_fp16":
        cos, sin = cos.half(), sin.half()
    elif change == "sin_shape":
        sin = sin[..., :16]
    elif change == "cos_tokens":
        cos, sin = cos[:, :2], sin[:, :2]
    elif change == "cos_odd":
        cos, sin = cos[..., :15], sin[..., :15]
    elif change == "cos_wide":
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    elif change == "weight_width":
        wq = torch.cat((wq,) * 4)
    elif change == "k_head_dim":
        k = k[..., :16]
    elif change == "llama_fp32_weight":
        wq = wq.float()
    for call in (qk_norm_rope_triton, qk_norm_rope_reference):
        with pytest.raises(ValueError) as raised:
            call(q, k, wq, wk, cos, sin, 1e-6, 0.0, cast, True)
        assert "\n" not in str(raised.value)


# --- qk_norm_rope_cache: k and v written into the KV cache by the same launch ---


def _cache_inputs(config, dtype, tokens, slots, seed, dv=None):
    hq, hk, d, r, per_head = config
    b, s = tokens
    g = torch.Generator().manual_seed(seed + 100)
    dv = dv or d
    v = torch.randn(b, s, hk, dv, generator=g).to(DEVICE, dtype)
    k_cache = torch.randn(b, hk, slots, d, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(b, hk, slots, dv, generator=g).to(DEVICE, dtype)
    return v, k_cache, v_cache


# (config, (B, S), cache slots, positions): decode steps at batch 1 (one sequence) and 3 from a
# first slot, a 3-token step from slot 4 (consecutive slots), and tokens at a slot each
CACHE_CASES = [
    ("qwen3", (1, 1), 7, [5]),
    ("qwen3_5", (3, 1), 6, 2),
    ("minimax_m2", (2, 3), 9, 4),
    ("odd", (2, 2), 5, [4, 0]),
    ("odd_whole_row", (1, 3), 8, [7, 2, 5]),
]


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "gptj"])
@pytest.mark.parametrize("case", CACHE_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cache_variant_is_the_kernel_and_index_copy(dtype, case, interleaved):
    """q_out and the key rows bit-equal qk_norm_rope_triton's split tiles (the same code), written
    at their slots with v transposed into the value cache (every other slot untouched), as
    index_copy would; within the reference's bound as qk_norm_rope_triton is tested above."""
    name, tokens, slots, positions = case
    config = CONFIGS[name]
    per_head = config[4]
    args = _inputs(config, dtype, "llama", tokens, seed=slots, interleaved=interleaved)
    v, k_cache, v_cache = _cache_inputs(config, dtype, tokens, slots, seed=slots, dv=config[2] + 4)
    positions = torch.tensor(positions, device=DEVICE)
    q, k, wq, wk, cos, sin = args
    q_out, k_new, v_new = qk_norm_rope_cache_triton(q, k, v, wq, wk, cos, sin, k_cache, v_cache, positions, 1e-6,
                                                    0.0, True, per_head, interleaved)  # fmt: skip
    assert k_new.data_ptr() != k_cache.data_ptr()  # a dispatcher call is functional
    plain_q, plain_k = qk_norm_rope_triton(*args, 1e-6, 0.0, True, per_head, interleaved, whole_head_tile=False)
    s = tokens[1]
    index = positions.reshape(-1) + (torch.arange(s, device=DEVICE) if positions.numel() == 1 else 0)
    assert torch.equal(q_out, plain_q) and q_out.stride() == plain_q.stride()
    assert torch.equal(k_new, k_cache.index_copy(2, index, plain_k))
    assert torch.equal(v_new, v_cache.index_copy(2, index, v.transpose(1, 2)))
    ref = qk_norm_rope_cache_reference(q, k, v, wq, wk, cos, sin, k_cache, v_cache, positions, 1e-6, 0.0, True,
                                       per_head, interleaved)  # fmt: skip
    _assert_close(k_new[:, :, index], ref[1][:, :, index], dtype)


def test_cache_variant_in_place_when_inlined_and_slots_past_the_cache_unwritten():
    config = CONFIGS["minimax_m2"]
    q, k, wq, wk, cos, sin = _inputs(config, torch.float32, "llama", (2, 2), seed=3)
    v, k_cache, v_cache = _cache_inputs(config, torch.float32, (2, 2), 5, seed=3)
    before = (k_cache.clone(), v_cache.clone())
    out = qk_norm_rope_cache_triton(q, k, v, wq, wk, cos, sin, k_cache, v_cache, torch.tensor(1), 1e-6, 0.0, True,
                                    False, wrap=lambda kernel: kernel)  # fmt: skip
    assert out[1] is k_cache and out[2] is v_cache
    assert torch.equal(v_cache[:, :, 1:3], v.transpose(1, 2)) and torch.equal(k_cache[:, :, 3:], before[0][:, :, 3:])
    _, k_new, v_new = qk_norm_rope_cache_triton(q, k, v, wq, wk, cos, sin, *before, torch.tensor([4, 5]), 1e-6, 0.0,
                                                True, False)  # fmt: skip
    assert torch.equal(k_new[:, :, :4], before[0][:, :, :4]) and torch.equal(v_new[:, :, 4], v[:, 0])


@pytest.mark.parametrize(
    "change,message",
    [(lambda a: {**a, "v": a["v"][:, :, :1]}, "v [2, 2, 2, Dv]"),
     (lambda a: {**a, "v_cache": a["v_cache"][:, :, :3]}, "the caches hold 5 and 3 slots"),
     (lambda a: {**a, "k_cache": a["k_cache"].to(torch.float16)}, "k_cache [2, 2, T, 32] torch.float32 expected"),
     (lambda a: {**a, "positions": torch.tensor([1, 2, 3])}, "positions must be 2 or 1")],  # fmt: skip
    ids=["v heads", "slots", "cache dtype", "positions"],
)
def test_cache_variant_bad_arguments_raise(change, message):
    import re

    config = CONFIGS["qwen3"]
    q, k, wq, wk, cos, sin = _inputs(config, torch.float32, "llama", (2, 2), seed=4)
    v, k_cache, v_cache = _cache_inputs(config, torch.float32, (2, 2), 5, seed=4)
    args = change({"v": v, "k_cache": k_cache, "v_cache": v_cache, "positions": torch.tensor(0)})
    with pytest.raises(ValueError, match=re.escape(message)):
        qk_norm_rope_cache(q, k, args["v"], wq, wk, cos, sin, args["k_cache"], args["v_cache"], args["positions"],
                           1e-6)  # fmt: skip


def test_cache_op_opcheck():
    config = CONFIGS["qwen3_5"]
    q, k, wq, wk, cos, sin = _inputs(config, torch.bfloat16, "offset", (2, 1), seed=5)
    v, k_cache, v_cache = _cache_inputs(config, torch.bfloat16, (2, 1), 4, seed=5)
    for positions in (torch.tensor(2), torch.tensor([3])):
        args = (q, k, v, wq, wk, cos, sin, k_cache, v_cache, positions.to(DEVICE), 1e-6, 1.0, False, True, False)
        torch.library.opcheck(qk_norm_rope_cache, args)
