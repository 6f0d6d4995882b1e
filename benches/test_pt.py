"""safetensors' ``bindings/python/benches/test_pt.py``, each case for safetensors 0.8 and safeload.

Same checkpoints (GPT-2: 12 layers of F32 zeros; LoRA: 500 pairs of 32x32 F32 zeros), same calls
(``load_file`` with the default backend and with ``backend="pread"``, plus ``backend="mmap"``;
``save_file`` into a new file). ``lib`` is parametrised in conftest.py and both libraries' cases
share a group, so ``pytest benches/test_pt.py`` prints each pair side by side and the terminal
summary prints the ratios. With ``--benchmark-disable`` the checkpoints shrink to a few KiB.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Tuple

import pytest
import torch


def create_gpt2(n_layers: int, hidden: int = 768, vocab: int = 50257, ctx: int = 1024) -> Dict[str, torch.Tensor]:
    """GPT-2's parameter names and shapes (the defaults are GPT-2 small), F32 zeros."""
    tensors = {"wte": torch.zeros((vocab, hidden)), "wpe": torch.zeros((ctx, hidden))}
    for i in range(n_layers):
        p = f"h.{i}."
        tensors[p + "ln_1.weight"] = torch.zeros((hidden,))
        tensors[p + "ln_1.bias"] = torch.zeros((hidden,))
        tensors[p + "attn.bias"] = torch.zeros((1, 1, ctx, ctx))
        tensors[p + "attn.c_attn.weight"] = torch.zeros((hidden, 3 * hidden))
        tensors[p + "attn.c_attn.bias"] = torch.zeros((3 * hidden,))
        tensors[p + "attn.c_proj.weight"] = torch.zeros((hidden, hidden))
        tensors[p + "attn.c_proj.bias"] = torch.zeros((hidden,))
        tensors[p + "ln_2.weight"] = torch.zeros((hidden,))
        tensors[p + "ln_2.bias"] = torch.zeros((hidden,))
        tensors[p + "mlp.c_fc.weight"] = torch.zeros((hidden, 4 * hidden))
        tensors[p + "mlp.c_fc.bias"] = torch.zeros((4 * hidden,))
        tensors[p + "mlp.c_proj.weight"] = torch.zeros((4 * hidden, hidden))
        tensors[p + "mlp.c_proj.bias"] = torch.zeros((hidden,))
    tensors["ln_f.weight"] = torch.zeros((hidden,))
    tensors["ln_f.bias"] = torch.zeros((hidden,))
    return tensors


def create_lora(n_pairs: int, rank: int = 32) -> Dict[str, torch.Tensor]:
    """A LoRA adapter: ``n_pairs`` up/down pairs of rank x rank F32 zeros."""
    tensors = {}
    for i in range(n_pairs):
        tensors[f"lora.{i}.up.weight"] = torch.zeros((rank, rank))
        tensors[f"lora.{i}.down.weight"] = torch.zeros((rank, rank))
    return tensors


def _write(tmp_path_factory: Any, name: str, weights: Dict[str, torch.Tensor]) -> Tuple[str, Dict[str, torch.Tensor]]:
    from safetensors.torch import save_file

    path = str(tmp_path_factory.mktemp("pt") / f"{name}.safetensors")
    save_file(weights, path)
    return path, weights


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: Any, tiny: bool) -> Tuple[str, Dict[str, torch.Tensor]]:
    weights = create_gpt2(1, hidden=64, vocab=500, ctx=64) if tiny else create_gpt2(12)
    return _write(tmp_path_factory, "gpt2", weights)


@pytest.fixture(scope="module")
def lora(tmp_path_factory: Any, tiny: bool) -> Tuple[str, Dict[str, torch.Tensor]]:
    weights = create_lora(20, rank=8) if tiny else create_lora(500)
    return _write(tmp_path_factory, "lora", weights)


def _check(result: Dict[str, torch.Tensor], weights: Dict[str, torch.Tensor]) -> None:
    assert sorted(result) == sorted(weights)
    for k, v in weights.items():
        assert result[k].shape == v.shape and torch.equal(result[k], v), k


def _load(benchmark: Any, record_pair: Any, lib_torch: Any, file: Tuple[str, Dict[str, torch.Tensor]],
          group: str, **kwargs: Any) -> None:
    path, weights = file
    benchmark.group = group
    result = benchmark(lib_torch.load_file, path, **kwargs)
    record_pair()
    _check(result, weights)


# -- GPT-2 (~0.5 GiB) --------------------------------------------------------------------------


def test_pt_sf_load_cpu(benchmark, record_pair, lib_torch, gpt2):
    _load(benchmark, record_pair, lib_torch, gpt2, "gpt2 load_file default")


def test_pt_sf_load_cpu_pread(benchmark, record_pair, lib_torch, gpt2):
    _load(benchmark, record_pair, lib_torch, gpt2, "gpt2 load_file pread", backend="pread")


def test_pt_sf_load_cpu_mmap(benchmark, record_pair, lib_torch, gpt2):
    _load(benchmark, record_pair, lib_torch, gpt2, "gpt2 load_file mmap", backend="mmap")


# -- LoRA (1000 tensors of 4 KiB) ---------------------------------------------------------------


def test_pt_sf_load_cpu_small(benchmark, record_pair, lib_torch, lora):
    _load(benchmark, record_pair, lib_torch, lora, "lora load_file default")


def test_pt_sf_load_cpu_small_pread(benchmark, record_pair, lib_torch, lora):
    _load(benchmark, record_pair, lib_torch, lora, "lora load_file pread", backend="pread")


def test_pt_sf_load_cpu_small_mmap(benchmark, record_pair, lib_torch, lora):
    _load(benchmark, record_pair, lib_torch, lora, "lora load_file mmap", backend="mmap")


# -- accelerators (skipped where absent) ----------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires cuda")
needs_mps = pytest.mark.skipif(
    not hasattr(torch.backends, "mps") or not torch.backends.mps.is_available(), reason="requires mps"
)


def _load_device(benchmark: Any, record_pair: Any, lib_torch: Any, file: Tuple[str, Dict[str, torch.Tensor]],
                 group: str, device: str, **kwargs: Any) -> None:
    path, weights = file
    benchmark.group = group
    result = benchmark(lib_torch.load_file, path, device=device, **kwargs)
    record_pair()
    _check({k: v.cpu() for k, v in result.items()}, weights)


@needs_cuda
def test_pt_sf_load_gpu(benchmark, record_pair, lib_torch, gpt2):
    _load_device(benchmark, record_pair, lib_torch, gpt2, "gpt2 load_file cuda default", "cuda:0")


@needs_cuda
def test_pt_sf_load_gpu_pread(benchmark, record_pair, lib_torch, gpt2):
    _load_device(benchmark, record_pair, lib_torch, gpt2, "gpt2 load_file cuda pread", "cuda:0", backend="pread")


@needs_mps
def test_pt_sf_load_mps(benchmark, record_pair, lib_torch, gpt2):
    _load_device(benchmark, record_pair, lib_torch, gpt2, "gpt2 load_file mps default", "mps")


@needs_mps
def test_pt_sf_load_mps_pread(benchmark, record_pair, lib_torch, gpt2):
    _load_device(benchmark, record_pair, lib_torch, gpt2, "gpt2 load_file mps pread", "mps", backend="pread")


# -- save ----------------------------------------------------------------------------------------


def test_pt_sf_save_cpu(benchmark, record_pair, lib_torch, gpt2, tmp_path):
    _, weights = gpt2
    filename = str(tmp_path / "saved.safetensors")

    def setup() -> None:
        # a new file every round, as safetensors' bench does: overwriting is slower on some filesystems
        if os.path.exists(filename):
            os.unlink(filename)

    benchmark.group = "gpt2 save_file"
    benchmark.pedantic(lib_torch.save_file, args=(weights, filename), setup=setup, iterations=1, rounds=5)
    record_pair()
    from safetensors.torch import load_file

    _check(load_file(filename), weights)
