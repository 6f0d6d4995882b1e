"""Device arguments: every form safetensors 0.8 accepts, plus ``torch.device`` objects.

Devices are checked against torch before any byte is read, so a device torch does not have
fails at ``safe_open`` with a clear message instead of half way through a load.
"""

from __future__ import annotations

from typing import Any

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
