"""The fake values below a fused op follow the layout of its output: a fused op whose output is
laid out otherwise than the subgraph it replaced leaves no stale strides in the views below it
(Inductor reads them: custom ops' stride-order constraints, the inlined Triton launches)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fusion_passes  # noqa: F401  (registers torch.ops.fusion_passes)
from fusion_passes.fake_values import refresh_fake_values


def _prompt_conv(x, weight):
    # the conv's output seen as the model reads it: transposed, split into q / k / v, heads
    out = torch.ops.fusion_passes.causal_conv1d(x, weight, None, True)
    q, k, v = torch.split(out.transpose(1, 2), [32, 32, 64], dim=-1)
    return q.reshape(2, 9, 2, 16), k.reshape(2, 9, 2, 16), v.reshape(2, 9, 4, 16).sin()


def _traced():
    with FakeTensorMode() as mode:
        x, weight = torch.empty(2, 128, 9), torch.empty(128, 4)
        gm = make_fx(_prompt_conv, tracing_mode="fake")(x, weight)
    for node in gm.graph.find_nodes(op="placeholder"):
        assert node.meta["val"].fake_mode is mode
    return gm.graph, mode


def _fused(graph):
    (node,) = graph.find_nodes(op="call_function", target=torch.ops.fusion_passes.causal_conv1d.default)
    return node


def test_views_below_a_fused_op_take_its_output_layout():
    graph, mode = _traced()
    node = _fused(graph)
    # the op's output as the other layout would lay it out ([B, C, T] contiguous, or [B, T, C] in
    # memory): the views below it were traced on the op's fake
    layouts = {(128 * 9, 9, 1), (128 * 9, 1, 128)}
    (other,) = layouts - {node.meta["val"].stride()}
    with mode:
        node.meta["val"] = torch.empty_strided((2, 128, 9), other)
    changed = refresh_fake_values(graph)
    outputs = graph.output_node().args[0]
    q, k, v = (n.meta["val"] for n in outputs)
    # the same views of a real tensor with that layout
    real = torch.empty_strided((2, 128, 9), other)
    rq, rk, rv = torch.split(real.transpose(1, 2), [32, 32, 64], dim=-1)
    assert q.stride() == rq.reshape(2, 9, 2, 16).stride() and k.stride() == rk.reshape(2, 9, 2, 16).stride()
    assert v.shape == (2, 9, 4, 16) and v.stride() == rv.reshape(2, 9, 4, 16).sin().stride()
    # transpose, split, its three items, three reshapes, sin: every value below the op changed
    assert changed == 9


def test_values_that_agree_are_left_alone():
    graph, _ = _traced()
    before = {n: n.meta.get("val") for n in graph.nodes}
    assert refresh_fake_values(graph) == 0
    assert all(n.meta.get("val") is before[n] for n in graph.nodes)
