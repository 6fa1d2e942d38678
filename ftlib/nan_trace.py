"""NaN trace: name the first module whose forward output or gradient went non-finite.

A NaN or Inf in training surfaces as a skipped step or a NaN loss, far from where it was born.
The trace hooks every module (forward hooks on outputs; tensor hooks on each module's input
and output tensors and on parameters during backward) and records the first non-finite value
in the order the values are computed:

- forward: modules return innermost first, so the innermost module whose output is
  non-finite is named;
- backward: autograd computes gradients from the loss back; a gradient that is finite at a
  module's output but not at its input was made non-finite by that module's backward.

Every check is a host sync: create a trace while hunting a NaN, ``remove()`` it afterwards.
``ftlib.optim.TrainOptimizer(nan_trace=...)`` reports ``first`` when it skips a step.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["NanTrace"]


def _tensors(x) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


class NanTrace:
    """Name the first module whose forward output or gradient went non-finite (hooks; debug aid).

    Forward: every module's outputs are checked as it returns, so the innermost module that
    produced a NaN/Inf is named first. Backward: hooks on each module's input and output
    tensors and on parameters fire in the order autograd computes the gradients; a gradient that
    is finite at a module's output but not at its input was made non-finite by that module's
    backward. Each check costs a host sync: create a trace only while hunting a NaN.

    ``first`` is e.g. ``"forward output of 'layers.1.mlp' (Linear)"`` or None.
    """

    def __init__(self, model: nn.Module):
        self.first: str | None = None
        self._first_key: tuple[int, str] | None = None
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_hook(self._forward_hook(name or "<root>")))
        for name, p in model.named_parameters():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._grad_hook(f"gradient of parameter '{name}'", None)))

    def _check(self, t: torch.Tensor) -> bool:
        return t.is_floating_point() and not bool(torch.isfinite(t).all())

    def _grad_hook(self, where: str, key: tuple[int, str] | None):
        def hook(grad):
            if self.first is None:
                if self._check(grad):
                    self.first, self._first_key = where, key
            elif key is not None and key[1] == "in" and self._first_key == (key[0], "out"):
                # the same tensor is the output of one module and the input of the next: its
                # gradient was made by the next module's backward, so that module is named
                self.first, self._first_key = where, key

        return hook

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            kind = type(module).__name__
            for t in _tensors(output):
                if self.first is None and self._check(t):
                    self.first = f"forward output of '{name}' ({kind})"
                if t.requires_grad and t.is_floating_point():
                    where = f"gradient at the output of '{name}' ({kind})"
                    t.register_hook(self._grad_hook(where, (id(t), "out")))
            for t in _tensors(inputs):
                if t.requires_grad and t.is_floating_point():
                    where = f"backward of '{name}' ({kind}): gradient w.r.t. its input"
                    t.register_hook(self._grad_hook(where, (id(t), "in")))

        return hook

    def reset(self) -> None:
        self.first, self._first_key = None, None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
