"""Mixture-of-experts loads through unmodified transformers ``from_pretrained``, stock (safetensors
0.8) against the patch, whose converters read every expert straight into its fused tensor
(``python/safeload/_moe.py``).

Tiny checkpoints written by transformers' own ``save_pretrained`` (one tensor per expert on disk)
load under the patch to parameters and logits equal to stock's, and the fused path ran (its DEBUG
records): qwen3_moe (``MergeModulelist`` + ``Concatenate``), mixtral (``w1``/``w3``/``w2``), a
dtype other than the file's, gpt-oss (experts fused on disk: read as slices), a 2-rank gloo load
with expert parallelism (each rank its own experts, and bytes read within its share). What the
patch does not recognise (another converter, synchronous loading) goes the stock way with equal
results; bad checkpoints (an expert missing, one of another shape or dtype, one too many, a
truncated shard) give what stock gives. No timing is asserted.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file as st_load, save_file as st_save  # noqa: E402

import safeload  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "support"))

from tp_rank import evict, header, run_ranks, touched_pages  # noqa: E402

LAYERS = 2
EXPERTS = 8


def _qwen3_moe(folder: Path, shard: str = "200KB") -> Path:
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, num_experts=EXPERTS, num_experts_per_tok=2, vocab_size=100)
    transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder, max_shard_size=shard)
    return folder


def _mixtral(folder: Path) -> Path:
    torch.manual_seed(1)
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                                     num_experts_per_tok=2, vocab_size=100)
    transformers.MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder, max_shard_size="100KB")
    return folder


def _gpt_oss(folder: Path) -> Path:
    torch.manual_seed(2)
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_local_experts=EXPERTS, num_experts_per_tok=2, vocab_size=100,
                                    layer_types=["full_attention"] * LAYERS)
    transformers.GptOssForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder, max_shard_size="100KB")
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {"qwen3_moe": _qwen3_moe(root / "qwen3_moe"), "mixtral": _mixtral(root / "mixtral"),
            "gpt_oss": _gpt_oss(root / "gpt_oss")}


class _Fused(logging.Handler):
    """The fused tensors safeload made (its DEBUG records), and its DEBUG lines."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.fused: list = []
        self.lines: list = []

    def emit(self, record: logging.LogRecord) -> None:
        got = getattr(record, "safeload_fused", None)
        if got is not None:
            self.fused.append(got)
        self.lines.append(record.getMessage())


def _load(path: Path, patched: bool, **kwargs):
    """(model, loading info, fused records) of an unmodified from_pretrained, stock or patched."""
    seen = _Fused()
    log = logging.getLogger("safeload")
    old = log.level
    log.addHandler(seen)
    log.setLevel(logging.DEBUG)
    try:
        if patched:
            with safeload.patched():
                model, info = transformers.AutoModelForCausalLM.from_pretrained(
                    path, output_loading_info=True, **kwargs)
        else:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    finally:
        log.removeHandler(seen)
        log.setLevel(old)
    return model, info, seen


def _assert_same(stock, ours) -> None:
    a, b = stock.state_dict(), ours.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name
    ids = torch.arange(12)[None] % stock.config.vocab_size
    with torch.no_grad():
        assert torch.equal(stock(ids).logits, ours(ids).logits)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_experts_read_into_their_fused_tensors_equal_stock(checkpoints, kind):
    stock, stock_info, _ = _load(checkpoints[kind], patched=False)
    ours, info, seen = _load(checkpoints[kind], patched=True)
    _assert_same(stock, ours)
    assert info == stock_info
    assert gc.isenabled()  # paused during transformers' loop, and on again after
    # every layer's gate_up_proj and down_proj made by safeload, from every expert's tensors
    assert sorted(f["target"] for f in seen.fused) == sorted(
        [".experts.gate_up_proj" if kind == "mixtral" else "mlp.experts.gate_up_proj"] * LAYERS
        + [".experts.down_proj" if kind == "mixtral" else "mlp.experts.down_proj"] * LAYERS)
    assert sorted(f["tensors"] for f in seen.fused) == [EXPERTS] * LAYERS + [EXPERTS * 2] * LAYERS


def test_a_dtype_other_than_the_files_converts_the_fused_tensor_as_stock(checkpoints):
    stock, _, _ = _load(checkpoints["qwen3_moe"], patched=False, dtype=torch.float32)
    ours, _, seen = _load(checkpoints["qwen3_moe"], patched=True, dtype=torch.float32)
    assert ours.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    _assert_same(stock, ours)
    assert len(seen.fused) == 2 * LAYERS


def test_experts_fused_on_disk_are_read_as_slices(checkpoints):
    files = sorted(checkpoints["gpt_oss"].glob("*.safetensors"))
    assert any(len(e["shape"]) == 3 for f in files for k, e in header(str(f))[1].items() if "experts" in k)
    stock, stock_info, _ = _load(checkpoints["gpt_oss"], patched=False)
    ours, info, seen = _load(checkpoints["gpt_oss"], patched=True)
    _assert_same(stock, ours)
    assert info == stock_info
    assert seen.fused == []  # no converter: transformers' own slices, read by safeload


def test_a_read_ahead_of_lists_that_grew_since_is_not_used(checkpoints, monkeypatch):
    """Each converter is read ahead as soon as it holds its first expert (too early: its lists
    grow after): those reads are dropped and each fused tensor is made again from its whole lists."""
    from safeload import _moe

    started = []

    def too_early(self, conv):  # called before the tensor is added: at the second, the list holds one
        if id(conv) in started:
            self.start(conv)
        started.append(id(conv))

    monkeypatch.setattr(_moe._Load, "opened", too_early)
    stock, _, _ = _load(checkpoints["qwen3_moe"], patched=False)
    ours, _, seen = _load(checkpoints["qwen3_moe"], patched=True)
    _assert_same(stock, ours)
    assert len(set(started)) == 2 * LAYERS
    # down_proj read from its first expert alone (gate_up's first lists lack up_proj: not read),
    # dropped, and every fused tensor made again from every expert
    assert sorted(f["tensors"] for f in seen.fused) == [1] * LAYERS + [EXPERTS] * LAYERS + [EXPERTS * 2] * LAYERS


def test_an_unrecognised_converter_goes_the_stock_way(checkpoints, monkeypatch):
    """A converter of another kind (here a subclass of MergeModulelist, as a model or quantizer
    may bring) is left to transformers: equal results, one DEBUG line saying why not."""
    cml = pytest.importorskip("transformers.core_model_loading")
    mapping = pytest.importorskip("transformers.conversion_mapping")

    class Stack(cml.MergeModulelist):
        pass

    converters = [
        cml.WeightConverter(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                            "mlp.experts.gate_up_proj", operations=[Stack(dim=0), cml.Concatenate(dim=1)]),
        cml.WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", operations=[Stack(dim=0)]),
    ]
    original = mapping.get_checkpoint_conversion_mapping("qwen3_moe")
    mapping.register_checkpoint_conversion_mapping("qwen3_moe", converters, overwrite=True)
    try:
        stock, _, _ = _load(checkpoints["qwen3_moe"], patched=False)
        ours, _, seen = _load(checkpoints["qwen3_moe"], patched=True)
    finally:
        mapping.register_checkpoint_conversion_mapping("qwen3_moe", original, overwrite=True)
    _assert_same(stock, ours)
    assert seen.fused == []


def test_synchronous_loading_goes_the_stock_way(checkpoints, monkeypatch):
    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", "1")
    stock, _, _ = _load(checkpoints["qwen3_moe"], patched=False)
    ours, _, seen = _load(checkpoints["qwen3_moe"], patched=True)
    _assert_same(stock, ours)
    assert seen.fused == []
    assert any("synchronously" in line for line in seen.lines)


def test_unpatch_puts_transformers_loader_back():
    cml = pytest.importorskip("transformers.core_model_loading")
    before = (cml.spawn_materialize, cml.WeightConverter.convert, cml.WeightConverter.add_tensor)
    with safeload.patched():
        assert cml.spawn_materialize is not before[0]
        assert cml.WeightConverter.convert is not before[1]
    assert (cml.spawn_materialize, cml.WeightConverter.convert, cml.WeightConverter.add_tensor) == before
    assert "add_tensor" not in cml.WeightConverter.__dict__


# -- bad checkpoints: what stock gives ------------------------------------------------------------


def _edit(src: Path, dst: Path, change) -> Path:
    """A copy of checkpoint ``src`` whose shard holding layer 0's expert 3 is rewritten by
    ``change(tensors)`` (safetensors 0.8 writes it)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    key = "model.layers.0.mlp.experts.3.gate_proj.weight"
    shard = dst / index["weight_map"][key]
    tensors = st_load(str(shard))
    change(tensors, index["weight_map"], shard.name)
    st_save(tensors, str(shard), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _missing(t, wm, shard):
    for p in ("gate_proj", "up_proj", "down_proj"):
        k = f"model.layers.0.mlp.experts.3.{p}.weight"
        if t.pop(k, None) is not None:
            wm.pop(k)


def _shape(t, wm, shard):
    k = "model.layers.0.mlp.experts.3.gate_proj.weight"
    t[k] = t[k][:-1].clone()


def _dtype(t, wm, shard):
    k = "model.layers.0.mlp.experts.3.gate_proj.weight"
    t[k] = t[k].to(torch.float16)


def _extra(t, wm, shard):
    for p in ("gate_proj", "up_proj", "down_proj"):
        k = f"model.layers.0.mlp.experts.3.{p}.weight"
        if k in t:
            t[k.replace("experts.3.", f"experts.{EXPERTS}.")] = t[k].clone()
            wm[k.replace("experts.3.", f"experts.{EXPERTS}.")] = shard


def _outcome(path: Path, patched: bool):
    try:
        model, info, seen = _load(path, patched)
    except Exception as exc:  # noqa: BLE001 - the exception is what is compared
        return type(exc), None, None
    return None, model, info


@pytest.mark.parametrize("change", [_missing, _shape, _dtype, _extra], ids=["missing", "shape", "dtype", "extra"])
def test_a_bad_expert_gives_what_stock_gives(checkpoints, tmp_path, change):
    bad = _edit(checkpoints["qwen3_moe"], tmp_path / "bad", change)
    stock_exc, stock, stock_info = _outcome(bad, patched=False)
    exc, ours, info = _outcome(bad, patched=True)
    assert exc is stock_exc
    if stock is not None:
        assert {k: sorted(map(str, v)) if isinstance(v, (set, list)) else v for k, v in info.items()} == \
            {k: sorted(map(str, v)) if isinstance(v, (set, list)) else v for k, v in stock_info.items()}
        a, b = stock.state_dict(), ours.state_dict()
        # parameters left to their initialisation (a mismatched or missing tensor) are random
        loaded = set(a) - set(stock_info["missing_keys"]) - {m[0] for m in stock_info["mismatched_keys"]}
        for name in loaded:
            assert torch.equal(a[name], b[name]), name


def test_a_truncated_shard_is_an_error_as_stock(checkpoints, tmp_path):
    bad = tmp_path / "truncated"
    shutil.copytree(checkpoints["qwen3_moe"], bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = bad / index["weight_map"]["model.layers.1.mlp.experts.5.down_proj.weight"]
    os.truncate(shard, shard.stat().st_size - 1000)
    stock_exc, _, _ = _outcome(bad, patched=False)
    assert stock_exc is not None
    with pytest.raises(Exception) as got:
        _load(bad, patched=True)
    assert isinstance(got.value, stock_exc) or type(got.value).__name__ == "SafetensorError"
    assert shard.name in str(got.value)


# -- expert parallelism: 2 gloo ranks -------------------------------------------------------------


def _assert_ranks_same(tmp_path: Path, stock: list) -> None:
    """Each rank's parameters and logits, patched, equal stock's."""
    assert all(r["fused"] == [] for r in stock)
    for rank in range(2):
        a = torch.load(tmp_path / "stock" / f"rank{rank}.pt")
        b = torch.load(tmp_path / "patch" / f"rank{rank}.pt")
        assert list(a["params"]) == list(b["params"])
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), (rank, name)
        assert torch.equal(a["logits"], b["logits"])


def _gloo() -> None:
    pytest.importorskip("accelerate")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


def test_a_tensor_parallel_moe_load_equals_stock(fresh_env, tmp_path):
    """``tp_plan="auto"`` on a MoE model (transformers 5.25 keeps its experts whole on each rank):
    every rank's fused tensors made by safeload, parameters and logits equal stock's."""
    _gloo()
    _qwen3_moe(tmp_path / "copy0", shard="1MB")
    shutil.copytree(tmp_path / "copy0", tmp_path / "copy1")
    env = {**fresh_env["env"], "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    model = str(tmp_path / "copy{rank}")
    stock = run_ranks(fresh_env["python"], env, model, tmp_path / "stock")
    patched = run_ranks(fresh_env["python"], {**env, "SAFELOAD_PATCH": "1"}, model, tmp_path / "patch")
    _assert_ranks_same(tmp_path, stock)
    assert all(len(r["fused"]) == 2 * LAYERS for r in patched)


def test_expert_parallel_ranks_read_their_experts_into_their_slice(fresh_env, tmp_path):
    _gloo()
    for k in range(2):  # each rank its own copy (ranks on separate nodes)
        _qwen3_moe(tmp_path / f"copy{k}", shard="1MB")
    env = {**fresh_env["env"], "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    model = str(tmp_path / "copy{rank}")
    stock = run_ranks(fresh_env["python"], env, model, tmp_path / "stock", "--ep", "2")
    for k in range(2):  # cold: what the kernel reads is what the rank asked for
        evict(tmp_path / f"copy{k}")
    patched = run_ranks(fresh_env["python"], {**env, "SAFELOAD_PATCH": "1"}, model, tmp_path / "patch", "--ep", "2")
    _assert_ranks_same(tmp_path, stock)
    for rank in range(2):
        fused = patched[rank]["fused"]
        assert len(fused) == 2 * LAYERS
        assert all(f["shape"][0] == EXPERTS // 2 for f in fused)
        # what this rank read, cold (safeload's count: the page cache does not see uncached reads),
        # within the pages of its share (dense tensors, its experts and
        # the headers), as tests/test_tp.py counts them
        pages = 0
        for f in sorted((tmp_path / f"copy{rank}").glob("*.safetensors")):
            known = header(str(f))
            mine = set(range(0, (known[0] - 1) // 4096 + 1))
            for name in known[1]:
                expert = name.split(".experts.")[1].split(".")[0] if ".experts." in name else None
                if expert is None or int(expert) // (EXPERTS // 2) == rank:
                    mine |= touched_pages(str(f), name, ["..."], known=known)
            pages += len(mine)
        share = pages * 4096
        read = sum(r["bytes_read"] for r in patched[rank]["reads"])
        assert share * 0.9 <= read <= share * 1.10, (rank, read, share)


def test_a_verified_load_checks_the_experts_bytes(checkpoints, tmp_path, monkeypatch):
    """``SAFELOAD_VERIFY`` with a ``SHA256SUMS`` beside the shards: the fused reads are served from
    bytes that hashed right, and one flipped bit of an expert refuses the load."""
    import hashlib

    good = tmp_path / "good"
    shutil.copytree(checkpoints["qwen3_moe"], good)
    (good / "SHA256SUMS").write_text("".join(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n"
                                             for f in sorted(good.glob("*.safetensors"))))
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    key = "model.layers.0.mlp.experts.5.up_proj.weight"
    shard = bad / index["weight_map"][key]
    start, entries = header(str(shard))
    data = bytearray(shard.read_bytes())
    data[start + entries[key]["data_offsets"][0] + 7] ^= 1
    shard.write_bytes(bytes(data))
    monkeypatch.setenv("SAFELOAD_VERIFY", "strict")
    stock, _, _ = _load(checkpoints["qwen3_moe"], patched=False)
    ours, _, seen = _load(good, patched=True)
    _assert_same(stock, ours)
    assert len(seen.fused) == 2 * LAYERS
    with pytest.raises(safeload.SafetensorError, match="SHA-256 mismatch"):
        _load(bad, patched=True)
