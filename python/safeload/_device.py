"""Device arguments: every form safetensors 0.8 accepts, plus ``torch.device`` objects.

Devices are checked against torch before any byte is read, so a device torch does not have
fails at ``safe_open`` with a clear message instead of half way through a load. Which framework
may go to which device is decided once, by :func:`target`, for ``safe_open`` and every loader.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple

from ._frameworks import converters, framework_name
from ._safeload import SafetensorError

_INDEXED = ("cuda", "musa", "npu", "xpu", "xla", "mlu", "hpu")


def parse(device: Any) -> str:
    """Returns a torch device string ("cpu", "cuda:0", "mps", "1" ...), as 0.8 would name it."""
    if device is None:
        return "cpu"
    if type(device).__name__ == "device" and type(device).__module__ == "torch":
        return str(device) if device.index is not None or device.type in ("cpu", "mps") else f"{device.type}:0"
    if isinstance(device, str):
        if device in ("cpu", "mps"):
            return device
        if device in _INDEXED:
            return f"{device}:0"
        kind, sep, index = device.partition(":")
        if sep and kind in _INDEXED + ("mps",):
            try:
                number = int(index)
                if number < 0 or not index.isdigit():
                    raise ValueError
            except ValueError:
                raise SafetensorError(f"device {device} is invalid") from None
            if kind == "mps":
                if number != 0:
                    raise SafetensorError(
                        f"device {device} is invalid: only mps or mps:0 is supported"
                    )
                return "mps"
            return f"{kind}:{number}"
        raise SafetensorError(f"device {device} is invalid")
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return str(device)
    raise SafetensorError(f"device {device!r} is invalid")


def torch_device(name: str) -> Any:
    """The torch.device for a parsed name, after checking torch has it."""
    import torch

    if name == "cpu":
        return torch.device("cpu")
    if name.isdigit():
        accel = getattr(torch, "accelerator", None)
        current = accel.current_accelerator() if accel is not None else None
        if current is None:
            raise SafetensorError(
                f"device {name} is not available: torch {torch.__version__} sees no accelerator"
            )
        name = f"{current.type}:{name}"
    kind, _, index = name.partition(":")
    module = getattr(torch, kind, None) if kind != "mps" else getattr(torch.backends, "mps", None)
    available = module is not None and hasattr(module, "is_available") and module.is_available()
    if not available:
        raise SafetensorError(
            f"device {name} is not available: torch {torch.__version__} has no usable {kind} backend"
        )
    if index and module is not None and hasattr(module, "device_count"):
        count = module.device_count()
        if int(index) >= count:
            raise SafetensorError(
                f"device {name} is not available: torch sees {count} {kind} device(s)"
            )
    return torch.device(name)


class Target(NamedTuple):
    """Where a load's tensors go: the framework (its own name), the device (parsed), the
    ``torch.device`` torch's tensors go to through the staging ring or ``.to`` (None: they stay on
    the CPU, or the framework places them itself), and the converters of the reader's
    ``(code, shape, bytes, name)``: one tensor's (``convert``) and a list's (``many``)."""

    framework: str
    device: str
    torch: Any
    convert: Callable[..., Any]
    many: Callable[..., Dict[str, Any]]

    def tensor(self, code: str, shape: List[int], data: Any, name: str = "") -> Any:
        """One tensor, on the device."""
        tensor = self.convert(code, shape, data, name)
        return tensor if self.torch is None else tensor.to(self.torch)


def target(framework: Any, device: Any) -> Target:
    """The one rule of safetensors 0.8 for a framework and a device: the CPU for every framework;
    another device for torch (checked against torch here) and for paddle (which makes its tensors
    there, "gpu:N" for "cuda:N"); for the rest ``Device X is not supported for framework Y``."""
    name = framework_name(framework)
    parsed = parse(device)
    if parsed != "cpu" and name not in ("pytorch", "paddle"):
        raise SafetensorError(f"Device {parsed} is not supported for framework {name}")
    on_torch = torch_device(parsed) if parsed != "cpu" and name == "pytorch" else None
    return Target(name, parsed, on_torch, *converters(name, parsed))
