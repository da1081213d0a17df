"""A small zoo of PyTorch models with random weights, and the input spec each one takes.

``make_model("mlp" | "cnn" | "encoder", device, dtype, size)`` builds one in eval mode.
The default sizes are the shapes of the reference GPU measurements (an MLP of 4 x 2048
linear layers, a three-layer CNN on 64 x 64 images, a 4-layer Transformer encoder on
128 tokens of width 512), so a GPU profile can be checked against them; ``size="tiny"``
shrinks each to run in milliseconds on a CPU (tests, quick notebooks). Nothing is
downloaded: weights are drawn from a seeded generator.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Integral

import torch
from torch import nn

from .. import _check

MODELS = ("mlp", "cnn", "encoder")
SIZES = ("default", "tiny")


@dataclass(frozen=True)
class InputSpec:
    """Shape (without the batch dimension) and dtype of one request's input tensor; the
    dtype may be named (``"int64"``), and a bad one of either raises ``ValueError``."""

    shape: tuple
    dtype: torch.dtype

    def __post_init__(self):
        shape = self.shape
        if (isinstance(shape, str) or not isinstance(shape, Iterable)
                or not all(isinstance(d, Integral) and not isinstance(d, bool) and d >= 0
                           for d in shape)):
            raise ValueError(f"shape must be a tuple of sizes >= 0, got {shape!r}")
        dtype = getattr(torch, self.dtype, None) if isinstance(self.dtype, str) else self.dtype
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch dtype or its name, such as 'float32', "
                             f"got {self.dtype!r}")
        object.__setattr__(self, "shape", torch.Size(shape))
        object.__setattr__(self, "dtype", dtype)

    def random(self, n: int, seed: int = 0, pin_memory: bool = False) -> torch.Tensor:
        """``n`` random inputs stacked as one ``(n, *shape)`` CPU tensor (standard normal)."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn((n, *self.shape), generator=g).to(self.dtype)
        return x.pin_memory() if pin_memory else x


def _mlp(width: int, layers: int) -> nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks)


def _cnn(channels: tuple[int, int, int], classes: int) -> nn.Module:
    c1, c2, c3 = channels
    return nn.Sequential(
        nn.Conv2d(3, c1, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c1, c2, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(c2, c3, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c3, classes))


def _encoder(d_model: int, heads: int, ffn: int, layers: int) -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model, heads, ffn, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


#: name -> size -> (builder, input shape)
_ZOO = {
    "mlp": {"default": (lambda: _mlp(2048, 4), (2048,)),
            "tiny": (lambda: _mlp(64, 4), (64,))},
    "cnn": {"default": (lambda: _cnn((64, 128, 256), 1000), (3, 64, 64)),
            "tiny": (lambda: _cnn((8, 16, 32), 10), (3, 16, 16))},
    "encoder": {"default": (lambda: _encoder(512, 8, 2048, 4), (128, 512)),
                "tiny": (lambda: _encoder(32, 4, 64, 2), (16, 32))},
}


def resolve_device(device=None) -> torch.device:
    """``device`` as a ``torch.device`` (None: CPU), refusing one that is not available."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must name a torch device such as 'cpu' or 'cuda', "
                         f"got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} is not available: torch sees no CUDA GPU")
    return dev


def model_device(model, device=None) -> torch.device:
    """Where ``model`` runs: ``device`` if given, else where its parameters are (a
    ``torch.nn.Module`` with some), else the CPU."""
    if device is None and isinstance(model, torch.nn.Module):
        device = next((p.device for p in model.parameters()), None)
    return resolve_device(device)


def resolve_dtype(dtype=None) -> torch.dtype:
    """``dtype`` as a ``torch.dtype`` (None: float32); accepts names like ``"bfloat16"``."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype such as 'float32' or "
                         f"'bfloat16', got {dtype!r}")
    return value


def make_model(name: str, device=None, dtype=None, size: str = "default",
               seed: int = 0) -> nn.Module:
    """Build zoo model ``name`` with random weights, in eval mode, on ``device``.

    The module carries ``input_spec`` (an ``InputSpec``: per-request shape and dtype)
    and ``zoo_name`` (``"mlp"``, or ``"tiny-mlp"`` for the tiny size), which
    ``DynamicBatcher`` and the profiler read. ``seed`` fixes the weights without
    touching torch's global random state.
    """
    _check.one_of("name", name, MODELS)
    _check.one_of("size", size, SIZES)
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    build, shape = _ZOO[name][size]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    model = model.to(device=dev, dtype=dt).eval().requires_grad_(False)
    model.input_spec = InputSpec(shape, dt)
    model.zoo_name = name if size == "default" else f"{size}-{name}"
    return model
