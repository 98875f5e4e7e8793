"""Tensor-parallel allreduce + (residual add +) RMSNorm -> ``allreduce_(add_)rms_norm``.

Under tensor parallelism (``parallelize_module``: column-wise q/k/v and gate/up, row-wise o_proj
and down_proj) every row-wise projection ends in an allreduce of the ranks' partial sums, and the
decoder layer then adds the residual and applies the next RMSNorm. Under torch.compile the
allreduce is the functional collective pair, whether the model calls
``funcol.all_reduce(x, "sum", group)``, DTensor's Partial -> Replicate redistribution, or an
in-place ``dist.all_reduce(x)`` (traced to the same nodes):

    s = _c10d_functional.wait_tensor(_c10d_functional.all_reduce(x, "sum", group_name))

Canonicalize, then fuse: the RMSNorm fusions (``requires=``) have already turned the residual add
and every norm spelling (Llama, F.rms_norm / nn.RMSNorm, Qwen's (1 + w)) into
``fusion_passes.add_rms_norm`` / ``rms_norm``; these patterns take such a call fed by the
allreduce. The add commutes bit for bit, so the canonical add_rms_norm may hold the sum as either
operand (``residual + s`` or ``s + residual`` as the model wrote it): both positions are spellings.

Unfused: s = wait(all_reduce(x)); y, r = add_rms_norm(s, residual, w, eps, offset, cast)
         (a collective writing s, then a norm kernel reading s and residual)
Fused:   y, r = allreduce_add_rms_norm(x, residual, w, eps, offset, cast, group_name)
         y, s = allreduce_rms_norm(x, w, eps, offset, cast, group_name)   (no residual add)

The process-group name is a string in the graph, and the pattern matcher compares strings
literally (only float/int scalars can become pattern arguments): ``Fusion.string_args`` traces
each pattern with a sentinel group name and points its use at the ``group_name`` placeholder, so
the name becomes a pattern argument matched at every site and handed to the fused call. The patterns hold no casts and no shapes (the canonical norm op carries them), so one
trace on meta tensors serves every dtype and shape without the matcher's re-trace on the real
values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

# The fused ops' registration (the patterns' replacements call them).
import fusion_passes.lowering.allreduce_rms_norm.op  # noqa: F401
from fusion_passes.lowering.allreduce_rms_norm.reference import check_allreduce_rms_norm_args
from fusion_passes.lowering.rms_norm.reference import RMSNormForm
from fusion_passes.fusion import (
    DEFAULT_SCALAR_SENTINEL,
    Fusion,
    Spelling,
)

# The name the patterns are traced with: no process group has it (names are "0", "1", ... or a
# user's tag), and no match depends on it: its use becomes the group_name pattern argument.
GROUP_SENTINEL = "fusion_passes:any_group"

NORM_FORMS = {  # as patterns/rms_norm.py registers them: (weight_offset, cast_before_weight)
    "llama": (0.0, True),
    "fp32_weight": (0.0, False),
    "offset": (1.0, False),
}


def reduced_sum(x, group_name):
    """What every spelling of a TP allreduce becomes in the post-grad graph."""
    reduced = torch.ops._c10d_functional.all_reduce.default(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor.default(reduced)


_VIEWS = (
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
)


def _is_call(node: Any, target: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target


def views_into_allreduce(graph: torch.fx.Graph) -> int:
    """Canonicalize: ``view(wait_tensor(all_reduce(x, "sum", g)), shape)`` becomes
    ``wait_tensor(all_reduce(view(x, shape), "sum", g))`` where the view is the sum's only use. A
    sum over the ranks is elementwise, so it commutes with a view of its input, bit for bit. A MoE
    block reshapes its experts' reduced output from (tokens, hidden) back to (batch, seq, hidden)
    before the residual add (Qwen3-MoE, MiniMax-M2 under tensor parallelism): moved, the allreduce
    feeds the add, as the patterns spell it. Returns how many views moved."""
    moved = 0
    for view in list(graph.nodes):
        if view.op != "call_function" or view.target not in _VIEWS:
            continue
        wait = view.args[0]
        if not _is_call(wait, torch.ops._c10d_functional.wait_tensor.default) or len(wait.users) != 1:
            continue
        reduce = wait.args[0]
        if not _is_call(reduce, torch.ops._c10d_functional.all_reduce.default) or len(reduce.users) != 1:
            continue
        if reduce.args[1] != "sum":
            continue
        x = reduce.args[0]
        try:  # the view must be valid on x's own strides (the collective's output is contiguous)
            viewed = view.target(x.meta["val"], *view.args[1:], **view.kwargs)
        except Exception:  # noqa: BLE001 - not expressible on x: leave this site as it is
            continue
        with graph.inserting_before(reduce):
            new_view = graph.call_function(view.target, (x, *view.args[1:]), dict(view.kwargs))
        new_view.meta = {**view.meta, "val": viewed}
        reduce.args = (new_view, *reduce.args[1:])
        reduce.meta["val"] = wait.meta["val"] = view.meta["val"]
        view.replace_all_uses_with(wait)
        graph.erase_node(view)
        moved += 1
    return moved


# --- spellings: the allreduce feeding the canonical norm ops ---


def _allreduce_add_norm(offset: float, cast: bool, reduced_first: bool, residual_used: bool):
    """reduced_first: where the sum sits in the canonical call. The RMSNorm fusion's pattern is
    ``residual + x``, so a model's ``residual + s`` puts s in the x slot (first) and its
    ``s + residual`` in the residual slot. residual_used: the new residual feeds later code (every
    norm but the model's last one)."""

    def pattern(x, residual, weight, group_name, eps):
        s = reduced_sum(x, group_name)
        a, b = (s, residual) if reduced_first else (residual, s)
        y, new_residual = torch.ops.fusion_passes.add_rms_norm.default(a, b, weight, eps, offset, cast)
        return (y, new_residual) if residual_used else y

    return pattern


def _allreduce_norm(offset: float, cast: bool):
    """The sum is an output too: where no residual is added (the first layer after a reduced
    embedding) it is the next residual. An intermediate node may be a pattern output whether or
    not code outside reads it, so this one spelling also matches a sum read only by the norm."""

    def pattern(x, weight, group_name, eps):
        s = reduced_sum(x, group_name)
        y = torch.ops.fusion_passes.rms_norm.default(s, weight, eps, offset, cast)
        return y, s

    return pattern


def _fused_add_norm(offset: float, cast: bool, residual_used: bool):
    def replacement(x, residual, weight, group_name, eps):
        y, new_residual = torch.ops.fusion_passes.allreduce_add_rms_norm.default(
            x, residual, weight, eps, offset, cast, group_name
        )
        return (y, new_residual) if residual_used else y

    return replacement


def _fused_norm(offset: float, cast: bool):
    def replacement(x, weight, group_name, eps):
        y, s = torch.ops.fusion_passes.allreduce_rms_norm.default(
            x, weight, eps, offset, cast, group_name
        )
        return y, s

    return replacement


def _check(offset: float, cast: bool):
    def check(values: dict[str, Any]) -> str | None:
        if not isinstance(values.get("group_name"), str):
            return f"group name is not a constant string ({values.get('group_name')!r})"
        try:
            check_allreduce_rms_norm_args(
                values["x"], values["weight"], RMSNormForm(values.get("eps", 0.0), offset, cast),
                values.get("residual"),
            )
        except ValueError as e:
            return str(e)
        return None

    return check


def _examples(with_residual: bool):
    """Meta tensors: the patterns call only ops with fake kernels (the collective's included), so
    they trace without a process group; the patterns hold no dtype, one example serves all."""

    def example_inputs():
        x = torch.empty(8, 16, device="meta")
        w = torch.empty(16, device="meta")
        tensors = (x, torch.empty_like(x), w) if with_residual else (x, w)
        yield (*tensors, GROUP_SENTINEL, DEFAULT_SCALAR_SENTINEL)

    return example_inputs


_NORM_TARGETS = ("fusion_passes.rms_norm.", "fusion_passes.add_rms_norm.", "aten.rsqrt.")


def feeds_a_norm(node: torch.fx.Node, depth: int = 5) -> bool:
    """Whether an all_reduce's sum reaches a norm (a canonical one, or an rsqrt no spelling
    raised) within ``depth`` ops (wait_tensor, a view, the residual add, casts): a candidate site
    of the allreduce fusions; an all_reduce feeding anything else (a logits gather) is not."""
    frontier = [node]
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users if u.op == "call_function"]
        if any(str(u.target).startswith(_NORM_TARGETS) for u in frontier):
            return True
    return False


def _fusion(name: str, summary: str, spellings: list[Spelling], with_residual: bool) -> Fusion:
    return Fusion(
        name=name,
        summary=summary,
        doc=__doc__.split("\n\n", 1)[1],
        spellings=tuple(spellings),
        example_inputs=_examples(with_residual),
        scalars={"eps": DEFAULT_SCALAR_SENTINEL},
        requires=("add_rms_norm", "rms_norm"),
        opt_in="tensor parallel only; its one-shot kernel is measured on two H200s over NVLink "
        "and on no other topology (elsewhere NCCL + the fused norm)",
        string_args={"group_name": GROUP_SENTINEL},
        canonicalize=views_into_allreduce,
        # Each all_reduce left that feeds a norm is a near miss, with the closest spelling.
        candidate_ops=("_c10d_functional.all_reduce.default",),
        candidate=feeds_a_norm,
        builtin=True,
    )


ALLREDUCE_ADD_RMS_NORM = _fusion(
    "allreduce_add_rms_norm",
    "TP allreduce + residual add + RMSNorm (every form) -> one allreduce_add_rms_norm",
    [
        Spelling(
            f"allreduce_{'residual_plus_sum' if first else 'sum_plus_residual'}_add_rms_norm_{form}"
            + ("" if used else "_last"),
            _allreduce_add_norm(offset, cast, first, used),
            _fused_add_norm(offset, cast, used),
            _check(offset, cast),
        )
        for form, (offset, cast) in NORM_FORMS.items()
        for first in (True, False)
        # The new residual reused first; "_last": the model's final norm, whose sum nothing reads.
        for used in (True, False)
    ],
    with_residual=True,
)

ALLREDUCE_RMS_NORM = _fusion(
    "allreduce_rms_norm",
    "TP allreduce + RMSNorm, no residual add (every form) -> one allreduce_rms_norm",
    [
        Spelling(
            f"allreduce_rms_norm_{form}",
            _allreduce_norm(offset, cast),
            _fused_norm(offset, cast),
            _check(offset, cast),
        )
        for form, (offset, cast) in NORM_FORMS.items()
    ],
    with_residual=False,
)

FUSIONS = (ALLREDUCE_ADD_RMS_NORM, ALLREDUCE_RMS_NORM)
