"""Direct Triton launches: inline a canonical op's Triton launcher into the Inductor graph.

A canonical op node left in the graph is called through the dispatcher at run time (custom-op
dispatch: Python wrapper, schema checks, then the Triton launch). Inlined, the node becomes
Inductor's own ``triton_kernel_wrapper_functional``: Inductor emits the kernel in its generated
code and launches it like its own kernels, and its buffer planning owns the outputs.

Runs after the patterns, on CUDA nodes only (CPU keeps the reference, which Inductor cannot
emit as Triton).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

# op overload -> launcher(*op_args, wrap=...) returning what the op returns. Each lowering module
# registers its own ops' launchers (register_launcher), next to the op it lowers.
LAUNCHERS: dict[Any, Callable[..., Any]] = {}
# op overload -> positions of the inputs its inlined launch overwrites in place (see register_launcher).
WRITES_INPUTS: dict[Any, tuple[int, ...]] = {}


def register_launcher(
    op: Any, writes_inputs: tuple[int, ...] = ()
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``launcher(*args_of_op, wrap)`` launches ``op``'s Triton kernel on CUDA tensors,
    applying ``wrap`` (torch.library.wrap_triton) to each kernel, and returns the op's outputs,
    none of them aliasing an input. Import triton inside the launcher: CPU-only users never need it.

    ``writes_inputs``: positions of inputs that an op returns updated (a KV cache's or a
    recurrent layer's state: ``new_state = op(..., state)``) and that the launch, given ``wrap``,
    overwrites in place and returns. Traced functionalized, the kernel's write becomes Inductor's
    functional Triton wrapper, which Inductor's reinplacing turns back into the in-place write
    where the graph copies the op's output into that input at its end (a cache update), dropping
    the copy; elsewhere Inductor clones the input first. Without ``wrap`` the launch must write a
    copy (the op is functional)."""

    def decorator(launcher: Callable[..., Any]) -> Callable[..., Any]:
        LAUNCHERS[op] = launcher
        WRITES_INPUTS[op] = tuple(writes_inputs)
        return launcher

    return decorator


def inline_triton_launches(graph: torch.fx.Graph) -> int:
    """Replace every CUDA canonical-op node by its traced Triton launch; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in LAUNCHERS:
            continue
        args = [torch.fx.map_arg(a, lambda n: n.meta["val"]) for a in node.args]
        first = next((value for _, value in _tensors(args)), None)
        if not (isinstance(first, torch.Tensor) and first.device.type == "cuda"):
            continue
        _inline(graph, node, LAUNCHERS[node.target], args, WRITES_INPUTS.get(node.target, ()))
        count += 1
    return count


def check_lowerable(graph: torch.fx.Graph) -> None:
    """Raise if Inductor could not lower a node of a traced launch: an op that Inductor
    decomposes before its post-grad passes (e.g. aten.transpose.int into permute) has no lowering
    of its own, and met after them it fails the whole compile. Raised here instead, the pass
    manager keeps the op's dispatch call and warns."""
    from torch._inductor.decomposition import decompositions
    from torch._inductor.lowering import lowerings

    for node in graph.nodes:
        if node.op == "call_function" and node.target not in lowerings and node.target in decompositions:
            raise RuntimeError(f"the traced launch calls {node.target}, which Inductor cannot lower here")


Position = int | tuple[int, int]  # an argument, or an element of a list argument (Tensor[])


def _tensors(args: list[Any]) -> list[tuple[Position, Any]]:
    """(position, value) of every tensor (or fx Node) among ``args``, list arguments' elements included."""
    found: list[tuple[Position, Any]] = []
    for i, a in enumerate(args):
        if isinstance(a, list):  # a Tensor[] argument (fx keeps lists; tuples are other values)
            found += [((i, j), e) for j, e in enumerate(a) if isinstance(e, (torch.Tensor, torch.fx.Node))]
        elif isinstance(a, (torch.Tensor, torch.fx.Node)):
            found.append((i, a))
    return found


def tensor_positions(args: list[Any]) -> list[Position]:
    """Where ``args`` hold tensors (or fx Nodes): the positions trace_launch takes."""
    return [position for position, _ in _tensors(args)]


def _at(args: list[Any], position: Position) -> Any:
    return args[position] if isinstance(position, int) else args[position[0]][position[1]]


def trace_launch(
    launcher: Callable[..., Any],
    args: list[Any],
    tensor_positions: list[Position],
    writes_inputs: tuple[int, ...] = (),
) -> torch.fx.GraphModule:
    """``launcher(*args, wrap=torch.library.wrap_triton)`` traced functionalized on ``args`` (the
    tensors at ``tensor_positions``, an argument's index or a list argument's (index, element),
    become the graph's inputs, in that order): the graph that replaces the op's node. Raises where
    it could not: a launch that writes an input the op does not return updated, or one that calls
    an op Inductor cannot lower after its post-grad passes. ``writes_inputs`` names arguments: a
    list argument's every element."""

    def launch(*tensors):
        full = [list(a) if isinstance(a, list) else a for a in args]
        for position, t in zip(tensor_positions, tensors):
            if isinstance(position, int):
                full[position] = t
            else:
                full[position[0]][position[1]] = t
        return launcher(*full, wrap=torch.library.wrap_triton)

    tensors = [_at(args, position) for position in tensor_positions]
    # The values are Inductor's fake tensors: trace under their mode (the Triton HOP needs it).
    # Imported here: Inductor's pattern matcher costs ~2.5 s to import, and importing
    # fusion_passes (its ops, for a user or the CLI's first line) needs none of it.
    from torch._guards import detect_fake_mode
    from torch._inductor.pattern_matcher import is_mutation_op
    from torch.fx.experimental.proxy_tensor import make_fx

    with detect_fake_mode(tensors) or contextlib.nullcontext():
        sub = make_fx(torch.func.functionalize(launch, remove="mutations"), tracing_mode="real")(
            *tensors
        )
    # Triton's mutation analysis must find that the kernel writes only the outputs it allocated,
    # or inputs the op returns updated: functionalization writes those back (copy_) at the end,
    # which is dropped here (the op's output is the updated value; Inductor reinplaces it). Any
    # other write-back into the op's inputs would break the functional post-grad graph.
    placeholders_in_order = [n for n in sub.graph.nodes if n.op == "placeholder"]
    written = {
        placeholders_in_order[k]
        for k, position in enumerate(tensor_positions)
        if (position if isinstance(position, int) else position[0]) in writes_inputs
    }
    returned: set[torch.fx.Node] = set()
    torch.fx.node.map_arg(sub.graph.output_node().args[0], returned.add)
    for n in list(sub.graph.nodes):
        if (
            n.op == "call_function"
            and n.target is torch.ops.aten.copy_.default
            and n.args[0] in written
            and n.args[1] in returned
            and not n.users
        ):
            sub.graph.erase_node(n)
    mutations = [n for n in sub.graph.nodes if n.op == "call_function" and is_mutation_op(n)]
    if mutations:
        raise RuntimeError(f"the traced launch writes its inputs ({mutations[0].format_node()})")
    sub.graph.eliminate_dead_code()
    check_lowerable(sub.graph)
    return sub


def _inline(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    launcher: Callable[..., Any],
    args: list[Any],
    writes_inputs: tuple[int, ...] = (),
) -> None:
    """Trace ``launcher`` (functionalized) on the node's fake values and splice it in."""
    positions = tensor_positions(list(node.args))
    sub = trace_launch(launcher, args, positions, writes_inputs)
    env: dict[torch.fx.Node, Any] = {}
    placeholders = iter(_at(list(node.args), position) for position in positions)
    result: Any = None
    with graph.inserting_before(node):
        for sub_node in sub.graph.nodes:
            if sub_node.op == "placeholder":
                env[sub_node] = next(placeholders)
            elif sub_node.op == "output":
                result = torch.fx.map_arg(sub_node.args[0], env.__getitem__)
            else:
                new = graph.node_copy(sub_node, env.__getitem__)
                for key in ("stack_trace", "nn_module_stack"):  # keep the report's provenance
                    if key in node.meta:
                        new.meta[key] = node.meta[key]
                env[sub_node] = new
    if isinstance(result, (tuple, list)):
        for user in list(node.users):
            assert user.target is operator.getitem, user
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)
