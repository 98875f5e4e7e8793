"""cache_lengths: the write counters of transformers' StaticCache layers (cumulative_length.add_),
every one of a graph, advanced by one advance_lengths op; checked on transformers' own StaticLayer
and on tiny models' decode steps, with the writes it must leave alone."""

from __future__ import annotations

import pytest
import torch
from _rewrites import compile_with, decode_steps, defaults_without
from torch import nn

import fusion_passes
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep


class StaticLayers(nn.Module):
    """Several transformers StaticLayers updated as a model's attention layers update theirs."""

    def __init__(self, n: int, max_cache_len: int = 16):
        super().__init__()
        from transformers.cache_utils import StaticLayer

        self.layers = [StaticLayer(max_cache_len=max_cache_len) for _ in range(n)]

    def forward(self, k, v):
        out = k.new_zeros(())
        for layer in self.layers:
            keys, values = layer.update(k, v)
            out = out + keys.float().sum() + values.float().sum()
        return out

    def state(self):
        return [t.clone() for layer in self.layers for t in (layer.cumulative_length, layer.keys, layer.values)]


def _prefilled(n: int):
    torch.manual_seed(0)
    layers = StaticLayers(n)
    layers(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))  # the prefill: 3 tokens, eager
    return layers


@pytest.mark.parametrize("n", [2, 5])
def test_every_layers_counter_in_one_op(n):
    eager, compiled_layers = _prefilled(n), _prefilled(n)
    report = fusion_passes.Report()
    step = torch.compile(compiled_layers, backend=fusion_passes.backend(["cache_lengths"], report=report),
                         fullgraph=True)  # fmt: skip
    for i in range(2):
        k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
        torch.testing.assert_close(step(k, v), eager(k, v))
        assert all(torch.equal(a, b) for a, b in zip(compiled_layers.state(), eager.state(), strict=True))
    assert [int(layer.cumulative_length) for layer in compiled_layers.layers] == [5] * n
    assert report.final()["cache_lengths"] == 1
    before, after = report.ops_before(), report.ops_after()
    assert after["fusion_passes.advance_lengths.default"] == 1
    assert before["aten.add.Tensor"] - after["aten.add.Tensor"] == n  # each counter's add
    assert before["aten.copy_.default"] == after["aten.copy_.default"]  # the writes stay, of the op's values


def test_one_counter_has_nothing_to_merge():
    layers = _prefilled(1)
    out, report = compile_with(["cache_lengths"], layers, (torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)))
    assert report.matches["cache_lengths"] == 0
    before, after = report.ops_before(), report.ops_after()
    assert before == after and after["fusion_passes.advance_lengths.default"] == 0


class MixedWrites(nn.Module):
    """Two int counters beside writes that are not a counter's advance: a float total, a counter
    advanced by a tensor (not a literal step)."""

    def __init__(self):
        super().__init__()
        for name in ("a", "b", "c"):
            self.register_buffer(name, torch.tensor(4))
        self.register_buffer("total", torch.tensor(0.5))

    def forward(self, x):
        self.a.add_(1)
        self.b.add_(2)
        self.c.add_(torch.full_like(self.c, 3))  # a tensor step: left alone
        self.total.add_(1.5)
        return x * 2


def test_only_int_counters_advanced_by_a_literal_are_merged():
    eager, compiled = MixedWrites(), MixedWrites()
    x = torch.randn(3)
    out, report = compile_with(["cache_lengths"], compiled, (x,))
    torch.testing.assert_close(out, eager(x))
    assert [int(compiled.a), int(compiled.b), int(compiled.c), float(compiled.total)] == [
        int(eager.a), int(eager.b), int(eager.c), float(eager.total)]  # fmt: skip
    assert report.final()["cache_lengths"] == 1
    site = next(s for s in report.sites if s.fusion == "cache_lengths")
    assert site.ops_removed.count("aten.add.Tensor") == 2  # a's and b's; c's and the float's stay
    assert report.ops_after()["aten.add.Tensor"] == report.ops_before()["aten.add.Tensor"] - 2


@pytest.mark.parametrize("model,counters", [("qwen3", 2), pytest.param("deepseek-v3.2", 4, marks=pytest.mark.slow)])
def test_decode_step_counters(model, counters):
    """A tiny model's decode step (StaticCache, 2 layers) with the defaults: its counters (DeepSeek
    V3.2's indexer keeps a second a layer) in one op; outputs, caches and counters equal the step
    with every other default."""
    built = build_model(model, size="tiny", dtype=torch.bfloat16, layers=2)
    step = DecodeStep(built.module, batch=2, context=8, steps=2)
    without, defaults = decode_steps(step, defaults_without("cache_lengths"))
    with_op, report = decode_steps(step, ["all"])
    assert report.final()["cache_lengths"] == 1 and len(step._lengths) == counters
    after = report.ops_after()
    assert after["fusion_passes.advance_lengths.default"] == 1
    # against the defaults' graph: each counter's add gone, its write kept (now of the op's value)
    assert defaults.ops_after()["aten.add.Tensor"] - after["aten.add.Tensor"] == counters
    assert defaults.ops_after()["aten.copy_.default"] == after["aten.copy_.default"]
    assert [int(t) for t in step._lengths] == [8 + 2] * counters
    assert all(torch.equal(a, b) for a, b in zip(with_op, without, strict=True))
