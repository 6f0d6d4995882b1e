"""One rule for which framework loads to which device (``_device.target``): safe_open,
load_checkpoint and iter_checkpoint decide alike for every framework and device, and as
safetensors 0.8 does: every framework on the CPU; torch and paddle on other devices too (paddle
makes its tensors there itself, "gpu:N" for "cuda:N"); "Device X is not supported for framework
Y" for the rest.

paddle, tensorflow, jax and mlx are not installed here: stand-ins record where each tensor was
asked to go, for safeload and for 0.8 alike."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

import safetensors
import safetensors.numpy as st_numpy

import safeload
from safeload import _checkpoint

FRAMEWORKS = ["pt", "np", "tf", "flax", "mlx", "paddle"]
DEVICES = ["cpu", None, "cuda", "cuda:1", "mps", 0, 2, "npu", "xpu:1"]


class Made:
    """A tensor of a stand-in framework: where it was asked to go (None: the framework's
    default, the CPU)."""

    def __init__(self, array, place=None):
        self.array = np.asarray(array)
        self.place = place


@pytest.fixture
def stand_ins(monkeypatch):
    paddle = types.ModuleType("paddle")
    paddle.__version__ = "2.6.0"  # 0.8 then reads through numpy and calls to_tensor(place=...)
    paddle.to_tensor = lambda a, place=None, **_: Made(a, place)
    tensorflow = types.ModuleType("tensorflow")
    tensorflow.convert_to_tensor = lambda a: Made(a)
    jax, jnp = types.ModuleType("jax"), types.ModuleType("jax.numpy")
    jnp.array = lambda a: Made(a)
    jax.numpy = jnp
    mlx, core = types.ModuleType("mlx"), types.ModuleType("mlx.core")
    core.array = lambda a: Made(a)
    mlx.core = core
    for module in (paddle, tensorflow, jax, jnp, mlx, core):
        monkeypatch.setitem(sys.modules, module.__name__, module)


def _where(tensor):
    if isinstance(tensor, Made):
        return "cpu" if tensor.place is None else tensor.place
    if isinstance(tensor, torch.Tensor):
        return str(tensor.device)
    assert isinstance(tensor, np.ndarray), type(tensor)
    return "cpu"


def _outcome(load):
    """("loaded", where the tensor went) or (exception type, message)."""
    try:
        return ("loaded", _where(load()))
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e))


def _safeload_open(path, framework, device):
    with safeload.safe_open(path, framework, device=device) as f:
        one, every, part = f.get_tensor("a"), f.get_tensors()["a"], f.get_slice("a")[:]
    assert _where(every) == _where(one) == _where(part)
    return one


def _reference_open(path, framework, device):
    with safetensors.safe_open(path, framework, device=device) as f:
        return f.get_tensor("a")


@pytest.mark.parametrize("device", DEVICES, ids=repr)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_safe_open_and_loaders_decide_alike(tmp_path, stand_ins, framework, device):
    path = str(tmp_path / "a.safetensors")
    st_numpy.save_file({"a": np.arange(6, dtype=np.float32)}, path)
    opened = _outcome(lambda: _safeload_open(path, framework, device))
    loaded = _outcome(lambda: _checkpoint.load_checkpoint(path, framework, device=device)["a"])
    streamed = _outcome(lambda: dict(_checkpoint.iter_checkpoint(path, framework, device=device))["a"])
    assert loaded == opened
    assert streamed == opened
    reference = _outcome(lambda: _reference_open(path, framework, device))
    if framework != "pt":
        assert opened == reference
    else:
        # torch on a device torch lacks: 0.8 opens and fails at the first read, safeload refuses
        # at open, checking with torch. Where torch has it, both load there.
        assert (opened[0] == "loaded") == (reference[0] == "loaded"), (opened, reference)
        if opened[0] == "loaded":
            assert opened == reference


def test_paddle_places_on_the_device_given(tmp_path, stand_ins):
    """What 0.8 does with paddle and an accelerator, pinned without the reference."""
    path = str(tmp_path / "a.safetensors")
    st_numpy.save_file({"a": np.arange(6, dtype=np.float32)}, path)
    for device, place in [("cpu", "cpu"), ("cuda", "gpu:0"), ("cuda:1", "gpu:1"), (2, 2), ("npu", "npu:0")]:
        got = _checkpoint.load_checkpoint(path, "paddle", device=device)["a"]
        assert (got.place, got.array.tolist()) == (place, list(range(6)))
