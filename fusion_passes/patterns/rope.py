"""RoPE spellings found in real model code, raised to the canonical ``rope`` op.

Each spelling is one tensor's rotation, starting from the cos / sin nodes the model multiplies by
(after whatever unsqueeze, index, gather or cast it did): x's layout ([B, S, H, D], [B, H, S, D],
flat [T, H, D]) and where the head transpose sits are not part of the pattern, and q and k are
two sites sharing those cos / sin nodes.

transformers (cos / sin [.., R] in x.dtype, one value per rotated element):
- Llama / Qwen3 / Gemma / Phi-3 (``rotate_half`` with slices, each op in x.dtype)
      q * cos + cat(-q[..., R/2:], q[..., :R/2]) * sin
- Olmo2: the same on fp32 cos / sin (q * cos promotes to fp32), the result cast back
      (q * cos + rotate_half(q) * sin).to(q.dtype)
- partial rotary (Qwen3-Next, Phi-3, GLM):  cat([rope(q[..., :R]), q[..., R:]], -1), R = cos width
- GLM4 (GPT-J pairs, cos / sin ``repeat_interleave(2)``-ed by the model, partial rotary)
      q * cos + stack((-q[..., 1::2], q[..., 0::2]), -1).flatten(-2) * sin
vLLM's native rotary (cos, sin = cos_sin_cache[positions].chunk(2, -1): half width, one value
per pair; widened here with cat (NeoX) / repeat_interleave (GPT-J), copies):
- NeoX:  x1, x2 = chunk(x, 2, -1); cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
- GPT-J: x1, x2 = x[..., ::2], x[..., 1::2]; stack((x1 * cos - x2 * sin, ...), -1).flatten(-2)
- partial: cat((rope(x[..., :R]), x[..., R:]), -1), R = 2 * cos width
gpt-fast (bf16 ``freqs_cis`` cache [.., R/2, 2]: cos, sin = its [..., 0], [..., 1]; fp32 math):
      xs = x.float().reshape(..., -1, 2)
      stack([xs0 * c - xs1 * s, xs1 * c + xs0 * s], -1).flatten(3).type_as(x)

Not raised: Meta's reference Llama / torchtitan complex form
(``view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) * freqs_cis)``). Inductor keeps
the complex multiply as an eager fallback (aten.mul on complex64), and eager's complex multiply is
not one rounding: on rows shorter than a vector it computes re = fma(a, c, -(b * d)),
im = fma(a, d, b * c) (one rounding per pair), on longer rows separate products (two roundings),
so no real-arithmetic reference reproduces it bit for bit (fp32 differs by an ulp). The
``rope_complex`` fusion matches it only to reject each site with that reason (in the report).

Unfused: the spelling's muls, neg / sub, cat or stack (fused by Inductor into its neighbours)
Fused:   fusion_passes.rope(x, cos, sin, interleaved, compute_fp32)   (consumed by a region
         fusion, else lowered back to its reference)
"""

from __future__ import annotations

from typing import Any

import torch

from fusion_passes.fusion import Fusion, Spelling
from fusion_passes.lowering.rope.reference import check_rope_args

# --- transformers (keep the op order exactly as the models write it) ---


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_interleaved(x):
    """GLM's ``rotate_half_llm``."""
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def llama_rope(x, cos, sin):
    return (x * cos) + (rotate_half(x) * sin)


def olmo2_rope(x, cos, sin):
    return ((x * cos) + (rotate_half(x) * sin)).to(x.dtype)


def glm_rope(x, cos, sin):
    return (x * cos) + (rotate_half_interleaved(x) * sin)


def _transformers_partial(rope):
    def partial(x, cos, sin):
        rotary_dim = cos.shape[-1]
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat([rope(x_rot, cos, sin), x_pass], dim=-1)

    partial.__name__ = f"{rope.__name__}_partial"
    return partial


# --- vLLM's _apply_rotary_emb_torch (cos / sin half width) ---


def vllm_neox_rope(x, cos, sin):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1)


def vllm_gptj_rope(x, cos, sin):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def _vllm_partial(rope):
    def partial(x, cos, sin):
        rotary_dim = 2 * cos.shape[-1]
        x_rot = x[..., :rotary_dim]
        x_pass = x[..., rotary_dim:]
        return torch.cat((rope(x_rot, cos, sin), x_pass), dim=-1)

    partial.__name__ = f"{rope.__name__}_partial"
    return partial


# --- gpt-fast's apply_rotary_emb (freqs_cis: the model's view of its cache, [.., R/2, 2]) ---


def gpt_fast_rope(x, freqs_cis):
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    x_out2 = x_out2.flatten(-2)
    return x_out2.type_as(x)


# --- Meta's reference Llama / torchtitan apply_rotary_emb (matched to be reported, not raised) ---


def complex_rope(x, freqs_cis):
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis).flatten(-2).type_as(x)


COMPLEX_REASON = (
    "complex RoPE not raised: eager's complex multiply rounds with an FMA on short rows and as "
    "separate products on long ones, which no real reference reproduces bit for bit"
)


def _reject_complex(values: dict[str, Any]) -> str | None:
    return COMPLEX_REASON


# --- the fused calls ---


def _compute_fp32(x, cos, upcast: bool) -> bool:
    """fp32 math where the spelling upcasts or cos / sin promote x; an fp32 x with fp32 cos / sin
    needs no flag, so those spellings raise to one form."""
    return cos.dtype != x.dtype or (upcast and x.dtype != torch.float32)


def _full_width(half, interleaved: bool):
    """A half-width cache (one value per pair) as the op reads it: one value per element."""
    return half.repeat_interleave(2, dim=-1) if interleaved else torch.cat([half, half], dim=-1)


def _replacement(interleaved: bool, upcast: bool, half_width: bool):
    def replacement(x, cos, sin):
        if half_width:
            cos, sin = _full_width(cos, interleaved), _full_width(sin, interleaved)
        return torch.ops.fusion_passes.rope.default(
            x, cos, sin, interleaved, _compute_fp32(x, cos, upcast)
        )

    return replacement


def _gpt_fast_replacement(x, freqs_cis):
    cos = _full_width(freqs_cis[..., 0], True)
    sin = _full_width(freqs_cis[..., 1], True)
    return torch.ops.fusion_passes.rope.default(x, cos, sin, True, _compute_fp32(x, cos, True))


def _check(interleaved: bool, upcast: bool, half_width: bool, partial: bool = False):
    """Reject what the op would compute differently: cos / sin that do not fit x, a promotion to
    fp32 without the cast back (the result would be fp32), a full-RoPE pattern on a narrower cos."""

    def check(values: dict[str, Any]) -> str | None:
        x, cos, sin = values["x"], values["cos"], values["sin"]
        if cos.dtype != sin.dtype or cos.shape != sin.shape:
            return f"cos {tuple(cos.shape)} {cos.dtype} and sin {tuple(sin.shape)} {sin.dtype} differ"
        if not upcast and cos.dtype != x.dtype:
            return f"cos/sin {cos.dtype} promote {x.dtype} x and nothing casts the result back"
        if cos.dim() == 0 or x.dim() == 0:
            return "scalar cos/sin"
        width = cos.shape[-1] * (2 if half_width else 1)
        if not partial and width != x.shape[-1]:
            return f"cos/sin span {width} dims, x {x.shape[-1]}: eager broadcasts them"
        full = (*cos.shape[:-1], width)
        try:
            check_rope_args(x, cos.new_empty(full), sin.new_empty(full), interleaved, upcast)
        except ValueError as e:
            return str(e)
        return None

    return check


def _check_gpt_fast(values: dict[str, Any]) -> str | None:
    x, freqs = values["x"], values["freqs_cis"]
    if freqs.dim() < 2 or freqs.shape[-1] != 2:
        return f"freqs_cis {tuple(freqs.shape)} is not [.., R/2, 2]"
    if 2 * freqs.shape[-2] != x.shape[-1]:
        return f"freqs_cis spans {2 * freqs.shape[-2]} dims, x {x.shape[-1]}"
    full = (*freqs.shape[:-2], 2 * freqs.shape[-2])
    try:
        check_rope_args(x, freqs.new_empty(full), freqs.new_empty(full), True, True)
    except ValueError as e:
        return str(e)
    return None


def _spelling(fn, interleaved: bool, upcast: bool, half_width: bool = False, partial: bool = False):
    return Spelling(
        fn.__name__,
        fn,
        _replacement(interleaved, upcast, half_width),
        _check(interleaved, upcast, half_width, partial),
    )


# --- examples: the shapes each group of spellings traces with ---

_DTYPES = (torch.float32, torch.bfloat16)


def _examples(cos_width: int, cos_fp32: bool = False):
    """x [2, 3, 5, 12]; cos / sin [2, 3, 1, cos_width] in x.dtype (and fp32 against bf16 x:
    Olmo2's promotion). fp32 and bf16 graphs differ where a spelling casts."""

    def example_inputs():
        for dtype in _DTYPES:
            x = torch.randn(2, 3, 5, 12, dtype=dtype)
            for cos_dtype in {dtype, torch.float32} if cos_fp32 else {dtype}:
                cos = torch.randn(2, 3, 1, cos_width, dtype=cos_dtype)
                yield x, cos, torch.randn_like(cos)

    return example_inputs


def _complex_examples():
    for dtype in _DTYPES:
        angles = torch.rand(1, 3, 1, 6)
        yield torch.randn(2, 3, 5, 12, dtype=dtype), torch.polar(torch.ones_like(angles), angles)


def _gpt_fast_examples():
    for dtype in _DTYPES:
        x = torch.randn(2, 3, 5, 12, dtype=dtype)
        # gpt-fast's cache is bf16 whatever the activations' dtype.
        yield x, torch.randn(1, 3, 1, 6, 2, dtype=torch.bfloat16)


def rotates(node) -> bool:
    """A neg that a RoPE rotation reads: rotate_half's cat((-x2, x1)), or GLM's stack((-x2, x1))
    (a cat of unsqueezes in the graph); not SiLU's or a sigmoid's neg (which feeds an exp)."""
    cat = torch.ops.aten.cat.default
    for user in node.users:
        if user.target == cat:
            return True
        if user.target == torch.ops.aten.unsqueeze.default and any(u.target == cat for u in user.users):
            return True
    return False


def _fusion(name: str, summary: str, spellings, example_inputs, near_misses: bool = False) -> Fusion:
    return Fusion(
        name=name,
        summary=f"RoPE, {summary} -> the canonical rope op",
        doc=__doc__.split("\n\n", 1)[1],
        spellings=tuple(spellings),
        example_inputs=example_inputs,
        # The negation of a rotation left in the graph marks an unraised RoPE (the spellings with
        # a neg: transformers'); vLLM's and gpt-fast's subtractions are too common to mark one.
        candidate_ops=("aten.neg.default",) if near_misses else (),
        candidate=rotates if near_misses else None,
        builtin=True,
    )


ROPE_PARTIAL = _fusion(
    "rope_partial",
    "transformers' partial rotary (Qwen3-Next, Phi-3, GLM): rotate the first R dims, cat the rest",
    [
        _spelling(_transformers_partial(llama_rope), False, False, partial=True),
        _spelling(_transformers_partial(glm_rope), True, False, partial=True),
    ],
    _examples(8),
    near_misses=True,
)
ROPE = _fusion(
    "rope",
    "transformers' apply_rotary_pos_emb (Llama, Qwen3, Gemma, Olmo2's fp32 cos, GLM's pairs)",
    [
        _spelling(llama_rope, False, False),
        # Olmo2's cast back is a no-op on x.dtype cos / sin: only its fp32-cos trace is its own
        # (the others are Llama's, already registered). Its anchor, the cast, is tried before
        # the add inside it that Llama's pattern would take.
        _spelling(olmo2_rope, False, True),
        _spelling(glm_rope, True, False),
    ],
    _examples(12, cos_fp32=True),
    near_misses=True,
)
ROPE_HALF_COS_PARTIAL = _fusion(
    "rope_half_cos_partial",
    "vLLM's native rotary with rotary_dim < head_size (half-width cos/sin from the cache)",
    [
        _spelling(_vllm_partial(vllm_neox_rope), False, False, half_width=True, partial=True),
        _spelling(_vllm_partial(vllm_gptj_rope), True, False, half_width=True, partial=True),
    ],
    _examples(4),
)
ROPE_HALF_COS = _fusion(
    "rope_half_cos",
    "vLLM's native rotary, NeoX (chunk) and GPT-J (even/odd) styles (half-width cos/sin)",
    [
        _spelling(vllm_neox_rope, False, False, half_width=True),
        _spelling(vllm_gptj_rope, True, False, half_width=True),
    ],
    _examples(6),
)
ROPE_GPT_FAST = _fusion(
    "rope_gpt_fast",
    "gpt-fast's apply_rotary_emb (real arithmetic in fp32 on a bf16 freqs_cis cache)",
    [Spelling("gpt_fast_rope", gpt_fast_rope, _gpt_fast_replacement, _check_gpt_fast)],
    _gpt_fast_examples,
)

ROPE_COMPLEX = _fusion(
    "rope_complex",
    "Meta's reference Llama / torchtitan complex form: matched only to report why it is not raised",
    # The replacement is never used: the check rejects every site with the reason.
    [Spelling("complex_rope", complex_rope, complex_rope, _reject_complex)],
    _complex_examples,
)

# Partial forms first: each contains its full form's pattern, which would take the inner part.
FUSIONS = (ROPE_PARTIAL, ROPE, ROPE_HALF_COS_PARTIAL, ROPE_HALF_COS, ROPE_GPT_FAST, ROPE_COMPLEX)
FAMILY = tuple(f.name for f in FUSIONS)
