"""QK-norm + RoPE: a region of canonical ops, fused into ``qk_norm_rope``.

Raise, then fuse: the RMSNorm fusions have turned q_norm / k_norm into ``fusion_passes.rms_norm``
calls, and the RoPE fusions (patterns/rope.py) every RoPE spelling into ``fusion_passes.rope``.
These patterns take both norms and the rope ops after them (q and k together, the same cos / sin
nodes: one kernel launch serves both), so every spelling that raises reaches them:

    q = rms_norm(q, q_w, eps)          per head ([.., H, D], weight [D]: Qwen3, Qwen3-Next,
                                       Qwen 3.5), or over all heads of a token ([.., H * D],
                                       weight [H * D], then viewed [.., H, D]: MiniMax-M2, Olmo2)
    q = q.transpose(1, 2)              where the model transposes before RoPE (transformers);
                                       absent where RoPE runs on [B, S, H, D] or flat [T, H, D]
                                       (Meta, gpt-fast, vLLM)
    q = rope(q, cos, sin, interleaved, compute_fp32)                        (k alike)
                                       (rotate_half or GPT-J pairs, x.dtype or fp32 math)

cos / sin are the rope ops' own (any shape that broadcasts: [B, 1, S, R], [1, S, 1, R],
[T, 1, R]); the replacement views them as the kernel's [B or 1, S, R] rows and rejects those that
vary over heads. R = cos.shape[-1] <= D (partial rotary: the rest passed through).

Unfused: 2 norm kernels (or 4 for the whole-row norm's reduction + scale) and the RoPE pointwise
         kernels, q and k written and read back between them.
Fused:   q, k = fusion_passes.qk_norm_rope(q, k, q_w, k_w, cos, sin, eps, weight_offset, cast,
                                           norm_per_head, interleaved)   (one kernel on CUDA;
         cos / sin cast to fp32 for the fp32 form: the kernel computes the RoPE in their dtype)

Not fused (the rope ops lower back): q and k of different cos / sin, RoPE forms or eps; a norm
of another width or axis; cos / sin that vary over heads.

eps and the head dim of the whole-row spellings are pattern arguments (scalars); head counts,
the head dim of the per-head spellings and the rotary dim are read from the matched shapes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from fusion_passes.lowering.qk_norm_rope.reference import check_qk_norm_rope_args
from fusion_passes.fusion import DEFAULT_SCALAR_SENTINEL, Fusion, NotASite, Spelling, is_enabled
from fusion_passes.patterns.rope import FAMILY as ROPE_FAMILY

# The whole-row spellings' head dim is traced with this sentinel: no other int of their traced
# graphs (example sizes, slice bounds) may equal it, or the matcher would take it for the head dim.
HEAD_DIM_SENTINEL = 24
# k_norm's eps is its own pattern argument: the check rejects a site whose two eps differ (one
# shared pattern argument was not enough: the matcher let the k norm's differ).
K_EPS_SENTINEL = 2 * DEFAULT_SCALAR_SENTINEL
_FORMS = {"llama": (0.0, True), "fp32_weight": (0.0, False), "offset": (1.0, False)}
# The rope op's forms: (interleaved, compute_fp32).
_ROPE_FORMS = {
    "rope": (False, False),
    "rope_fp32": (False, True),
    "rope_interleaved": (True, False),
    "rope_interleaved_fp32": (True, True),
}

# --- spellings: canonical norm op(s) -> [view] -> [transpose] -> canonical rope op ---


def _pattern(per_head: bool, transposed: bool, offset: float, cast: bool, interleaved: bool, fp32: bool):
    norm = torch.ops.fusion_passes.rms_norm.default
    rope = torch.ops.fusion_passes.rope.default

    def heads(x, weight, eps, head_dim=None):
        y = norm(x, weight, eps, offset, cast)
        if head_dim is not None:
            y = y.view(*x.shape[:-1], -1, head_dim)
        return y.transpose(1, 2) if transposed else y

    if per_head:

        def pattern(q, k, q_weight, k_weight, cos, sin, eps, k_eps):
            q = rope(heads(q, q_weight, eps), cos, sin, interleaved, fp32)
            k = rope(heads(k, k_weight, k_eps), cos, sin, interleaved, fp32)
            return q, k

    else:

        def pattern(q, k, q_weight, k_weight, cos, sin, eps, k_eps, head_dim):
            q = rope(heads(q, q_weight, eps, head_dim), cos, sin, interleaved, fp32)
            k = rope(heads(k, k_weight, k_eps, head_dim), cos, sin, interleaved, fp32)
            return q, k

    return pattern


def _head_view(x, per_head: bool, head_dim):
    """q / k as [.., H, D] (the whole-row norm's input viewed in heads) and as [B, S, H, D]
    (flat tokens [T, H, D] as one sequence)."""
    if not per_head:
        x = x.view(*x.shape[:-1], -1, head_dim)
    return x.unsqueeze(0) if x.dim() == 3 else x


def cos_rows(cos, rope_rank: int, transposed: bool) -> torch.Tensor:
    """cos / sin as the rope op broadcasts them against its input (rank ``rope_rank``: [B, H, S, D]
    after the transpose, [B, S, H, D] before it, [T, H, D] flat) -> the kernel's [B or 1, S or 1, R]
    rows; raises ValueError when they vary over heads."""
    if cos.dim() > rope_rank:
        raise ValueError(f"cos/sin {tuple(cos.shape)} have more dims than the rotated tensor")
    c = cos.reshape((1,) * (rope_rank - cos.dim()) + tuple(cos.shape))
    if rope_rank == 3:
        c = c.unsqueeze(0)
    if rope_rank != 4 and rope_rank != 3:
        raise ValueError(f"the rotated tensor has rank {rope_rank} (expected 4, or 3 for flat tokens)")
    if transposed:
        c = c.transpose(1, 2)
    if c.shape[2] != 1:
        raise ValueError(f"cos/sin {tuple(cos.shape)} vary over heads")
    return c.squeeze(2)


def _replacement(per_head: bool, transposed: bool, offset: float, cast: bool, interleaved: bool, fp32: bool):
    def fused(q, k, q_weight, k_weight, cos, sin, eps, head_dim):
        rank = q.dim() + (0 if per_head else 1)  # the rope op's input rank
        qh, kh = _head_view(q, per_head, head_dim), _head_view(k, per_head, head_dim)
        c, s = cos_rows(cos, rank, transposed), cos_rows(sin, rank, transposed)
        tokens = qh.shape[1]
        c, s = c.expand(c.shape[0], tokens, c.shape[2]), s.expand(s.shape[0], tokens, s.shape[2])
        if fp32:  # the kernel computes the RoPE in cos's dtype (fp32: rounded once at the end)
            c, s = c.float(), s.float()
        q_out, k_out = torch.ops.fusion_passes.qk_norm_rope.default(
            qh, kh, q_weight, k_weight, c, s, eps, offset, cast, per_head, interleaved
        )  # [B, H, S, D] transposes of contiguous [B, S, H, D] tensors
        if not transposed:
            q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
        if rank == 3:
            q_out, k_out = q_out.squeeze(0), k_out.squeeze(0)
        return q_out, k_out

    if per_head:

        def replacement(q, k, q_weight, k_weight, cos, sin, eps, k_eps):
            return fused(q, k, q_weight, k_weight, cos, sin, eps, None)

    else:

        def replacement(q, k, q_weight, k_weight, cos, sin, eps, k_eps, head_dim):
            return fused(q, k, q_weight, k_weight, cos, sin, eps, head_dim)

    return replacement


def _check(per_head: bool, transposed: bool, offset: float, cast: bool, interleaved: bool, fp32: bool):
    """Reject what the fused op would compute differently: another eps, dtypes, cos/sin that vary
    over heads, weights of another width (a norm over another axis)."""

    def check(values: dict[str, Any]) -> str | None:
        q, k = values["q"], values["k"]
        if q is k:
            # The matcher finds k's branch from the nodes q's branch shares with it (cos / sin)
            # and may bind it to q's own branch when k's does not match (e.g. another eps).
            return NotASite("the k branch matched q's own nodes: no separate k norm + RoPE")
        if values["eps"] != values["k_eps"]:
            return f"q_norm eps {values['eps']} != k_norm eps {values['k_eps']} (the op has one)"
        head_dim = None
        if not per_head:
            head_dim = values["head_dim"]
            if q.shape[-1] % head_dim or k.shape[-1] % head_dim:
                return f"projection widths {q.shape[-1]}, {k.shape[-1]} not heads of {head_dim}"
        rank = q.dim() + (0 if per_head else 1)
        if rank not in (3, 4) or k.dim() != q.dim():
            return f"q {tuple(q.shape)}, k {tuple(k.shape)}: expected [B, S, H, D] or flat [T, H, D] heads"
        if transposed and rank != 4:
            return f"a transpose of rank-{rank} heads (expected [B, S, H, D])"
        qh, kh = _head_view(q, per_head, head_dim), _head_view(k, per_head, head_dim)
        try:
            c = cos_rows(values["cos"], rank, transposed)
            s = cos_rows(values["sin"], rank, transposed)
        except ValueError as e:
            return str(e)
        tokens = qh.shape[1]
        if c.shape[1] not in (1, tokens):
            return f"cos/sin {tuple(values['cos'].shape)} do not broadcast over {tokens} tokens"
        c, s = c.expand(c.shape[0], tokens, c.shape[2]), s.expand(s.shape[0], tokens, s.shape[2])
        if fp32:
            c, s = c.float(), s.float()
        elif c.dtype != q.dtype:
            return f"cos/sin {c.dtype} against {q.dtype} q without fp32 RoPE math"
        try:
            check_qk_norm_rope_args(
                qh, kh, values["q_weight"], values["k_weight"], c, s, offset, cast, per_head,
                interleaved,
            )
        except ValueError as e:
            return str(e)
        return None

    return check


def _examples(per_head: bool):
    """fp32 only: canonical ops have no casts, so every dtype traces one pattern. Sizes avoid
    HEAD_DIM_SENTINEL everywhere but the whole-row spellings' head dim; cos [1, 1, R] broadcasts
    against the heads before and after the transpose."""

    def example_inputs():
        b, s, hq, hk = 2, 3, 4, 2
        d = 16 if per_head else HEAD_DIM_SENTINEL
        q, k = torch.randn(b, s, hq, d), torch.randn(b, s, hk, d)
        w_q, w_k = torch.randn(d), torch.randn(d)
        if not per_head:
            q, k = q.flatten(-2), k.flatten(-2)
            w_q, w_k = torch.randn(hq * d), torch.randn(hk * d)
        cos, sin = torch.randn(1, 1, d), torch.randn(1, 1, d)
        scalars = (DEFAULT_SCALAR_SENTINEL, K_EPS_SENTINEL)
        scalars += () if per_head else (HEAD_DIM_SENTINEL,)
        yield (q, k, w_q, w_k, cos, sin, *scalars)
        if not per_head:
            # Flat tokens [T, H * D] (vLLM): the view's shape holds the head dim, so its length
            # is part of the pattern. cos two wide: the transposed spellings, traced on these
            # too, rotate [T, D, H].
            cos, sin = torch.randn(1, 1, 2), torch.randn(1, 1, 2)
            yield (q.flatten(0, 1), k.flatten(0, 1), w_q, w_k, cos, sin, *scalars)

    return example_inputs


def _spellings(per_head: bool) -> list[Spelling]:
    out = []
    scope = "per_head" if per_head else "whole_row"
    for transposed in (True, False):
        for form, (offset, cast) in _FORMS.items():
            for rope_form, (interleaved, fp32) in _ROPE_FORMS.items():
                where = "transposed_" if transposed else ""
                args = (per_head, transposed, offset, cast)
                out.append(
                    Spelling(
                        f"{scope}_{form}_norm_{where}{rope_form}",
                        _pattern(*args, interleaved, fp32),
                        _replacement(*args, interleaved, fp32),
                        _check(*args, interleaved, fp32),
                    )
                )
    return out


def _fold_views(rope_node: torch.fx.Node) -> int:
    """Views between a norm and the rope op written as two reshapes (vLLM: the per-head norm's
    [T, H, D] viewed back to [T, H * D], then viewed [T, H, D] by the rotary embedding) folded
    into one, and dropped where it leaves the shape as it was: the patterns see norm -> rope."""
    reshape = torch.ops.aten.reshape.default
    moved = 0
    x = rope_node.args[0]
    while (
        isinstance(x, torch.fx.Node) and x.target == reshape
        and isinstance(x.args[0], torch.fx.Node) and x.args[0].target == reshape
    ):  # fmt: skip
        x.args = (x.args[0].args[0], *x.args[1:])  # reshape(reshape(y, a), b) == reshape(y, b)
        moved += 1
    if isinstance(x, torch.fx.Node) and x.target == reshape:
        src = x.args[0]
        shapes = [getattr(n.meta.get("val"), "shape", None) for n in (x, src)]
        if (
            shapes[0] is not None and shapes[0] == shapes[1]
            and all(isinstance(d, int) for d in shapes[0])
        ):  # fmt: skip
            rope_node.replace_input_with(x, src)
            moved += 1
    return moved


def _same_value(a: Any, b: Any, depth: int = 8) -> bool:
    """a and b compute the same thing: one node, or the same pure op of the same arguments."""
    if a is b:
        return True
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return not isinstance(a, torch.fx.Node) and not isinstance(b, torch.fx.Node) and a == b
    if depth == 0 or a.op != "call_function" or a.target != b.target or a.kwargs != b.kwargs:
        return False
    if torch.Tag.nondeterministic_seeded in getattr(a.target, "tags", ()):
        return False
    if len(a.args) != len(b.args):
        return False
    return all(_same_value(x, y, depth - 1) for x, y in zip(a.args, b.args))


def pair_rope_ops(graph: torch.fx.Graph) -> int:
    """Bring q's and k's rope ops into the patterns' shape (the math unchanged):

    - views between the norm and the rope folded (see _fold_views);
    - cos / sin computed twice for two consecutive rope ops (q's and k's: gpt-fast views its
      cache in each call, vLLM unsqueezes its halves in each call, the raise rule widens each
      copy) made one node, which the pattern needs (q and k take the same cos / sin). Only
      consecutive pairs: a node shared further (by every layer) would let the matcher pair q of
      one layer with k of another;
    - each rope op's uses re-added in graph order, so the matcher, anchored at k's rope, finds q's
      rope (not k's own) first among the users of their shared cos.
    Returns how many nodes it folded or shared."""
    rope = torch.ops.fusion_passes.rope.default
    ropes = [n for n in graph.nodes if n.op == "call_function" and n.target == rope]
    moved = sum(_fold_views(n) for n in ropes)
    previous = None
    for node in ropes:
        if previous is not None and len(node.args) == len(previous.args):
            if all(_same_value(a, b) for a, b in zip(node.args[1:], previous.args[1:])):
                for i in (1, 2):
                    if node.args[i] is not previous.args[i]:
                        node.replace_input_with(node.args[i], previous.args[i])
                        moved += 1
                previous = None  # a pair: the next rope op starts another
                continue
        previous = node
    for node in ropes:
        node.args = tuple(node.args)  # appended to its inputs' users, in graph order
    graph.eliminate_dead_code()
    return moved


# What a KV-cache write is in a post-grad graph: transformers' StaticLayer.update writes with
# index_copy_ (re-inplaced as index_put_); the views between the rope and the write are followed.
_CACHE_WRITES = {
    torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
    torch.ops.aten.index_copy_.default, torch.ops.aten.index_copy.default,
}  # fmt: skip
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.permute.default,
          torch.ops.aten.transpose.int, torch.ops.aten.unsqueeze.default}  # fmt: skip


def _written_to_cache(node: torch.fx.Node, depth: int = 3) -> bool:
    """Whether ``node``'s value is written into a tensor in place (a KV cache) within ``depth`` views."""
    frontier = [node]
    for _ in range(depth + 1):
        if any(u.target in _CACHE_WRITES and u.args[-1] is n for n in frontier for u in n.users):
            return True
        frontier = [u for n in frontier for u in n.users if u.target in _VIEWS]
    return False


def _stored_as_it_is(node: torch.fx.Node, batch) -> bool:
    """Whether ``node`` goes into a cache as it is, or (a batch of one stored by indexing, which
    torch.compile traces with the batch dim dropped) through one reshape: the writes that
    qk_norm_rope_cache takes."""
    if _written_to_cache(node, depth=0):
        return True
    reshapes = [u for u in node.users if u.target is torch.ops.aten.reshape.default]
    return batch == 1 and any(_written_to_cache(r, depth=0) for r in reshapes)


def decode_cache_write_refusal(match) -> str | None:
    """Per-head QK-norm + RoPE of a decode step (one token per sequence, [B, 1, H, D]) whose k goes
    straight into a KV cache is left to Inductor: there stock Inductor fuses the RoPE table (cos /
    sin from the positions), both norms, both rotations and the k cache write into one kernel,
    and the fused op would add the write's kernel. Measured on one H200 (Qwen3-30B-A3B width, 2
    layers, after 1024 tokens): 71 vs 70 kernels at batch 1, 69 vs 68 at 64, step time equal. The
    whole-row form (MiniMax-M2) is not refused: there the fused op is 1.05x at batch 1. Nor is a
    site whose k goes into the cache as it is (_stored_as_it_is: the writes qk_norm_rope_cache
    takes) while that fusion is enabled: it moves the cache writes into the op."""
    q = match.kwargs.get("q")
    val = q.meta.get("val") if isinstance(q, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 4 or val.shape[1] != 1:
        return None
    written = [out for out in match.output_nodes() if out is not None and _written_to_cache(out)]
    if not written:
        return None
    if is_enabled("qk_norm_rope_cache") and all(_stored_as_it_is(out, val.shape[0]) for out in written):
        return None  # that fusion takes the site further, with the cache writes
    return ("a decode step's k goes into the KV cache: stock Inductor fuses the RoPE table, "
            "the norms, the rotations and the cache write into one kernel there")  # fmt: skip


FAMILY = ("qk_norm_rope", "qk_norm_rope_whole_row")
_VARIANTS = {"qk_norm_rope_whole_row": False, "qk_norm_rope": True}  # name: per_head, in order


def _fusion(name: str) -> Fusion:
    per_head = _VARIANTS[name]
    scalars: dict[str, float] = {"eps": DEFAULT_SCALAR_SENTINEL, "k_eps": K_EPS_SENTINEL}
    if not per_head:
        scalars["head_dim"] = HEAD_DIM_SENTINEL
    where = {
        "qk_norm_rope": "per-head norm (Qwen3, Qwen3-Next, Qwen 3.5; vLLM's flat tokens)",
        "qk_norm_rope_whole_row": "norm over all heads (MiniMax-M2, Olmo2)",
    }[name]
    first = name == next(iter(_VARIANTS))  # its canonicalization serves both
    return Fusion(
        name=name,
        summary=f"q/k RMSNorm + RoPE, {where} -> one qk_norm_rope kernel",
        doc=__doc__.split("\n\n", 1)[1],
        spellings=tuple(_spellings(per_head)),
        example_inputs=_examples(per_head),
        scalars=scalars,
        canonicalize=pair_rope_ops if first else None,
        match_check=decode_cache_write_refusal if per_head else None,
        # Enabling qk_norm_rope by name enables the whole family (and the ops it starts from).
        requires=("rms_norm", *ROPE_FAMILY) + (FAMILY[1:] if name == "qk_norm_rope" else ()),
        builtin=True,
    )


FUSIONS = tuple(_fusion(name) for name in _VARIANTS)
