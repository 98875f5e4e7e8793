"""One cached decode step of a transformers model, as a module torch.compile can take whole.

    step = DecodeStep(model, batch=8, context=1024, steps=16)   # prefills its StaticCache eagerly
    compiled = torch.compile(step, fullgraph=True)
    out = compiled(*step.inputs(0))       # token at position `context`: attends to the cache, writes it
    step.restore()                        # the cache as the prefill left it (every variant starts there)

``forward(input_ids [B, 1], cache_position [1])`` runs the model on a transformers ``StaticCache``
(keys / values written in place with ``index_copy_``; linear-attention layers' conv and recurrent
states updated in place) and returns the last hidden state, or the logits of a ``*ForCausalLM``.
The cache's tensors keep their addresses across steps and restores, so a step can be captured in a
CUDA graph.

The prefill is eager: every compiled variant starts from the same cache, and a decode step's
difference from eager is the step's own, not a different prefill's.
"""

from __future__ import annotations

import torch
from torch import nn


class DecodeError(ValueError):
    """A model or cache the decode step does not support (a one-line reason)."""


def _cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor a cache's layers hold (keys, values, conv / recurrent states, lengths), in a
    stable order: what a step mutates, so what a restore copies back."""
    tensors: list[torch.Tensor] = []
    for layer in cache.layers:
        for _, value in sorted(vars(layer).items()):
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            tensors += [t for t in items if isinstance(t, torch.Tensor)]
    return tensors


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model the step calls: the model itself, or the one a LastHiddenState wraps."""
    from fusion_passes.models.registry import LastHiddenState

    inner = model.model if isinstance(model, LastHiddenState) else model
    config = getattr(inner, "config", None)
    if config is None or not hasattr(inner, "get_input_embeddings"):
        raise DecodeError(
            f"decode needs a transformers model (a PreTrainedModel with a config); got {type(model).__name__}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise DecodeError(f"decode supports decoder-only models; {type(inner).__name__} is an encoder-decoder")
    return inner


class DecodeStep(nn.Module):
    """One decode step of ``model`` at ``batch`` sequences after a ``context``-token prefill, with
    room for ``steps`` more tokens; the prefill runs in the constructor (eager, no grad)."""

    def __init__(self, model: nn.Module, batch: int, context: int, steps: int = 16, seed: int = 0):
        super().__init__()
        if batch < 1 or context < 1 or steps < 1:
            raise DecodeError(f"batch, context and steps must be >= 1, got {batch}, {context}, {steps}")
        from transformers import StaticCache

        self.model = _base_model(model)
        self.batch, self.context, self.steps = batch, context, steps
        config = self.model.config
        try:
            self.cache = StaticCache(config=config, max_cache_len=context + steps)
        except Exception as e:  # a config the cache classes do not know
            raise DecodeError(f"StaticCache does not support {type(self.model).__name__}: {e}") from e
        param = next(self.model.parameters())
        g = torch.Generator().manual_seed(seed)
        vocab = config.get_text_config(decoder=True).vocab_size
        # The prompt, then one token per step (teacher forcing: every variant reads the same tokens).
        self.prompt = torch.randint(0, vocab, (batch, context), generator=g).to(param.device)
        self.tokens = torch.randint(0, vocab, (steps, batch, 1), generator=g).to(param.device)
        with torch.no_grad():
            try:
                self._call(self.prompt, torch.arange(context, device=param.device))
            except (TypeError, ValueError) as e:
                raise DecodeError(f"{type(self.model).__name__} does not decode with a StaticCache: {e}") from e
        self._snapshot = [t.clone() for t in _cache_tensors(self.cache)]
        # Every write counter: cumulative_length, and the DSA indexer's indexer_cumulative_length.
        self._lengths = [
            value
            for layer in self.cache.layers
            for name, value in sorted(vars(layer).items())
            if name.endswith("cumulative_length") and isinstance(value, torch.Tensor)
        ]

    def _call(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids, past_key_values=self.cache, cache_position=cache_position, use_cache=True
        )
        return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        # StaticLayer writes at its own counters (cumulative_length, the indexer's, advanced by each update), not at
        # cache_position: set it from the position, as an engine's step does, so that a step repeated
        # at one position (a timing loop, a CUDA-graph replay) rewrites one slot instead of running
        # past the cache. Functionalized, this set and the layer's own add_ are one write.
        for length in self._lengths:
            length.copy_(cache_position[0])
        return self._call(input_ids, cache_position)

    def inputs(self, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [B, 1], cache_position [1]) of decode step ``step`` (0: the first after the prefill)."""
        if not 0 <= step < self.steps:
            raise DecodeError(f"step {step} is outside the cache's room for {self.steps} steps")
        position = torch.tensor([self.context + step], device=self.prompt.device)
        return self.tokens[step], position

    def cache_tensors(self) -> list[torch.Tensor]:
        """The cache's tensors as they are now (for comparing the cache contents of two variants)."""
        return _cache_tensors(self.cache)

    @torch.no_grad()
    def restore(self) -> None:
        """Put the cache back as the prefill left it, in place (addresses kept for CUDA graphs)."""
        for live, saved in zip(_cache_tensors(self.cache), self._snapshot, strict=True):
            live.copy_(saved)
