"""Capture a Hugging Face model without its weights, and index its safetensors checkpoint.

The model is built from config.json with its parameters on the ``meta`` device (no memory;
buffers such as rotary ``inv_freq`` are computed as usual, they are small), then every
parameter becomes a data-less CPU ``FakeTensor`` and the model is exported with
:func:`quantkit.capture`: the graph is the one an in-memory capture gives, and no weight
byte is read. The checkpoint is indexed from its safetensors headers only.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from .._errors import CaptureError, QuantkitError
from .._sizing import DTYPE_BYTES, check_config, checkpoint_shapes
from ._capture import CAPTURE_META_KEY, capture

__all__ = ["empty_model", "fake_parameters", "fake_inputs", "capture_without_weights", "CheckpointIndex",
           "index_checkpoint"]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Within: every parameter a module registers is moved to the meta device (buffers stay
    real: they are computed from the config, e.g. rotary frequencies, and are not all in
    the checkpoint)."""
    register = torch.nn.Module.register_parameter

    def on_meta(self, name, param):
        register(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def empty_model(model_dir: str | os.PathLike, task: str = "auto") -> torch.nn.Module:
    """The model class of ``model_dir`` (see :func:`quantkit._hf.model_class`) built from its
    config.json with parameters on the meta device; in eval mode. config.json's sizes are
    checked against the checkpoint first (:func:`quantkit._sizing.check_config`): a config
    with layers or rows the checkpoint does not have is refused before anything is built.

    Raises:
        QuantkitError: no usable config.json or architecture, or sizes that do not fit the
            checkpoint (one line).
    """
    check_config(model_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from .._hf import model_class

    cls, _ = model_class(model_dir, task)
    transformers.logging.set_verbosity_error()
    try:
        config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
        with _parameters_on_meta():
            model = cls(config)
    except QuantkitError:
        raise
    except Exception as exc:  # transformers raises many types
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise QuantkitError(f"could not build {cls.__name__} from {str(Path(model_dir) / 'config.json')!r}: "
                            f"{first[:200]}") from exc
    return model.eval()


def fake_parameters(model: torch.nn.Module):
    """Replace every parameter of ``model`` (in place) with a data-less CPU ``FakeTensor`` of its
    shape and dtype; tied parameters stay one object. Returns the ``FakeTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                with mode:
                    fake = torch.empty(p.shape, dtype=p.dtype, device="cpu")
                memo[id(p)] = torch.nn.Parameter(fake, requires_grad=False)
            module._parameters[name] = memo[id(p)]
    return mode


def fake_inputs(mode, value: Any):
    """``value`` (tensors in tuples, lists, dicts) with every tensor made a fake tensor of ``mode``."""
    if isinstance(value, torch.Tensor):
        return mode.from_tensor(value)
    if isinstance(value, (tuple, list)):
        return type(value)(fake_inputs(mode, v) for v in value)
    if isinstance(value, dict):
        return {k: fake_inputs(mode, v) for k, v in value.items()}
    return value


def capture_without_weights(model: torch.nn.Module, example_inputs: Any, *, dynamic_shapes=None) -> torch.fx.GraphModule:
    """:func:`quantkit.capture` of a model from :func:`empty_model`, with no weight data.

    The parameters become fake tensors (so the returned graph's parameter attributes hold no
    data: load them before running it); the capture record keeps the real example inputs,
    so the converted graph exports as an in-memory capture's does.

    Raises:
        CaptureError: torch.export could not capture the model.
    """
    mode = fake_parameters(model)
    from ._inputs import as_args_kwargs

    args, kwargs = as_args_kwargs(example_inputs)
    gm = capture(model, fake_inputs(mode, kwargs) if kwargs else fake_inputs(mode, args),
                 dynamic_shapes=dynamic_shapes)
    record = gm.meta[CAPTURE_META_KEY]
    record["args"], record["kwargs"] = args, kwargs
    for name, t in list(gm.named_buffers()):
        if t.device.type == "meta":  # computed from a meta parameter at init: no value to run with
            raise CaptureError(f"buffer {name!r} of {type(model).__name__} is computed from the weights at init; "
                               "this model cannot be captured without its weights, quantize it in memory")
    return gm


@dataclass(frozen=True)
class CheckpointIndex:
    """Where each tensor of a safetensors checkpoint lives: ``entries[name] = (file, shape, dtype)``."""

    directory: Path
    entries: dict[str, tuple[str, tuple[int, ...], str]]

    def total_bytes(self) -> int:
        return sum(_numel(shape) * DTYPE_BYTES.get(dtype, 4) for _, shape, dtype in self.entries.values())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def index_checkpoint(model_dir: str | os.PathLike) -> CheckpointIndex:
    """Read the headers of every ``*.safetensors`` file in ``model_dir`` (no tensor data).

    Raises:
        QuantkitError: no safetensors file (a ``pytorch_model.bin`` checkpoint cannot be
            streamed), an unreadable file, or a tensor stored in two files.
    """
    directory = Path(model_dir)
    shapes = checkpoint_shapes(directory)
    if shapes is None:
        raise QuantkitError(f"{str(directory)!r} has no .safetensors weights; block-by-block quantization reads "
                            "safetensors only, re-save the model with save_pretrained(safe_serialization=True)")
    return CheckpointIndex(directory, {k: (t.file, t.shape, t.dtype) for k, t in shapes.items()})
