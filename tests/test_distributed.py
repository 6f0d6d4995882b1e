"""Multi-process loading (safeload.distributed) on gloo: 2 and 4 ranks started with spawn.

Each world size is started once (module fixture); the ranks run every scenario in turn and write
what they saw to JSON files that the tests below check. Joins have deadlines: a hang fails."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any, Dict, List

import pytest
import torch

import safetensors.torch as st_torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from safeload import distributed as sd_dist  # noqa: E402
from conftest import run_ranks  # noqa: E402

JOIN_SECONDS = 120
GROUP_TIMEOUT = timedelta(seconds=30)


# -- the checkpoint -------------------------------------------------------------------------------


def _write_checkpoint(root: str) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    shards: List[Dict[str, torch.Tensor]] = [
        {
            "embed.weight": torch.randn(256, 192, generator=g),  # 192 KiB
            "layer0.norm": torch.randn(192, generator=g).to(torch.bfloat16),
            "layer0.q": torch.randn(192, 192, generator=g).to(torch.float16),
            "layer0.k": torch.randn(192, 192, generator=g).to(torch.float16),
            "layer0.mask": torch.rand(64, 64, generator=g) > 0.5,
            "layer0.steps": torch.tensor(7, dtype=torch.int64),  # 0-dim
        },
        {
            "big.rows": torch.randn(256, 256, generator=g),  # 256 KiB, row-planned
            "layer1.norm": torch.randn(192, generator=g).to(torch.bfloat16),
            "layer1.q": torch.randn(192, 192, generator=g).to(torch.float16),
            "layer1.k": torch.randn(192, 192, generator=g).to(torch.float16),
            "layer1.ids": torch.randint(0, 1000, (4096,), generator=g),
            "layer1.empty": torch.empty(0, 5),
        },
        {
            "big.cols": torch.randn(256, 256, generator=g),  # 256 KiB, column-planned
            "layer2.norm": torch.randn(192, generator=g).to(torch.bfloat16),
            "layer2.q": torch.randn(192, 192, generator=g).to(torch.float16),
            "layer2.k": torch.randn(192, 192, generator=g).to(torch.float16),
            "head.weight": torch.randn(192, 256, generator=g),
            "head.bias": torch.randn(256, generator=g).to(torch.float64),
        },
    ]
    weight_map = {}
    files = []
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        st_torch.save_file(tensors, os.path.join(root, fname))
        files.append(os.path.join(root, fname))
        weight_map.update({n: fname for n in tensors})
    index = os.path.join(root, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    total = sum(t.nelement() * t.element_size() for s in shards for t in s.values())
    return {"index": index, "files": files, "total": total}


def _reference(files: List[str]) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for f in files:
        out.update(st_torch.load_file(f))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _block(n: int, rank: int, world: int) -> slice:
    step = n // world
    return slice(rank * step, (rank + 1) * step)


# -- what each rank runs --------------------------------------------------------------------------


def _worker(rank: int, world: int, tmp: str, ckpt: Dict[str, Any]) -> None:
    import safeload.torch as sl_torch
    from safeload import SafetensorError
    from safeload import distributed

    # Small batches so that both paths (batched and one tensor per message) run on a small file.
    distributed.SMALL_BYTES = 64 << 10
    distributed.BUCKET_BYTES = 160 << 10
    distributed.BATCH_BYTES = 256 << 10  # several rounds of reads and transfers
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=world, timeout=GROUP_TIMEOUT)
    res: Dict[str, Any] = {}
    ref = _reference(ckpt["files"])
    group = dist.group.WORLD

    # 1. The whole state dict on every rank.
    state, stats = sl_torch.load_checkpoint(ckpt["index"], process_group=group, backend="pread", return_stats=True)
    res["full_keys"] = sorted(state) == sorted(ref)
    res["full_equal"] = all(_same(state[k], ref[k]) for k in ref if k in state)
    ptrs = [sl_torch.storage_ptr(t) for t in state.values() if t.nelement()]
    res["distinct_storage"] = len(ptrs) == len(set(ptrs))
    res["bytes_read"] = stats.bytes_read
    res["stats_type"] = type(stats).__name__

    # 2. Per-rank slices: a row block and a column block (tensor parallelism).
    rows, cols = _block(256, rank, world), _block(256, rank, world)
    plan = {"big.rows": (rows,), "big.cols": (slice(None), cols), "head.bias": ...}
    sliced, pstats = sl_torch.load_checkpoint(ckpt["index"], plan=plan, backend="pread", return_stats=True)
    res["plan_keys"] = sorted(sliced) == sorted(plan)
    res["plan_equal"] = (_same(sliced["big.rows"], ref["big.rows"][rows])
                         and _same(sliced["big.cols"], ref["big.cols"][:, cols])
                         and _same(sliced["head.bias"], ref["head.bias"]))
    res["plan_bytes"] = pstats.bytes_read
    res["plan_out_bytes"] = sum(t.nelement() * t.element_size() for t in sliced.values())
    res["plan_full_bytes"] = sum(ref[k].nelement() * ref[k].element_size() for k in plan)
    # The same plan with the group: the ranks agree on failures, results are the same.
    sliced2 = sl_torch.load_checkpoint(ckpt["index"], plan=plan, process_group=group)
    res["plan_group_equal"] = all(_same(sliced2[k], sliced[k]) for k in plan)

    # 3. Per-rank selections (default group): each rank gets exactly what it asked for.
    names = sorted(ref)
    mine = [n for i, n in enumerate(names) if i % world == rank] + ["embed.weight"]
    got, sstats = sl_torch.load_checkpoint(ckpt["index"], selection=mine, backend="pread", return_stats=True)
    res["selection_keys"] = sorted(got) == sorted(set(mine))
    res["selection_equal"] = all(_same(got[k], ref[k]) for k in got)
    res["selection_bytes"] = sstats.bytes_read
    # ranks_needing: only rank 0 needs head.weight, nobody reads what is not listed for it.
    needing = {n: [0] for n in names if n != "embed.weight"}
    got = sl_torch.load_checkpoint(ckpt["index"], ranks_needing=needing, process_group=group)
    expect = sorted(names) if rank == 0 else ["embed.weight"]
    res["needing_keys"] = sorted(got) == expect
    res["needing_equal"] = all(_same(got[k], ref[k]) for k in got)

    # 4. A rank that cannot even open the checkpoint: every rank raises.
    bad = ckpt["index"] if rank != 1 else os.path.join(tmp, "missing", "model.safetensors.index.json")
    started = time.monotonic()
    try:
        sl_torch.load_checkpoint(bad, process_group=group)
        res["plan_failure"] = "no error"
    except SafetensorError as e:
        res["plan_failure"] = str(e)
    res["plan_failure_seconds"] = time.monotonic() - started

    # 5. A rank whose read fails in its second batch (after the first batch's transfers were
    #    posted): every rank raises, naming it.
    last = world - 1
    if rank == last:
        calls = []
        read_share = distributed._read_share

        def broken(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                raise OSError("injected read failure")
            return read_share(*args, **kwargs)
        distributed._read_share = broken
    started = time.monotonic()
    try:
        sl_torch.load_checkpoint(ckpt["index"], process_group=group)
        res["read_failure"] = "no error"
    except SafetensorError as e:
        res["read_failure"] = str(e)
    res["read_failure_seconds"] = time.monotonic() - started

    # 6. The group is still usable afterwards.
    if rank == last:
        distributed._read_share = read_share
    again = sl_torch.load_checkpoint(ckpt["index"], process_group=group)
    res["after_failure_equal"] = sorted(again) == sorted(ref) and all(_same(again[k], ref[k]) for k in ref)
    dist.barrier()
    with open(os.path.join(tmp, f"result-{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def _run(world: int, tmp: str, ckpt: Dict[str, Any]) -> List[Dict[str, Any]]:
    return run_ranks(_worker, world, tmp, (world, tmp, ckpt), JOIN_SECONDS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: Any) -> Dict[str, Any]:
    return _write_checkpoint(str(tmp_path_factory.mktemp("ckpt")))


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request: Any, checkpoint: Dict[str, Any], tmp_path_factory: Any) -> Any:
    world = request.param
    tmp = str(tmp_path_factory.mktemp(f"world{world}"))
    return world, checkpoint, _run(world, tmp, checkpoint)


# -- the tests ------------------------------------------------------------------------------------


def test_every_rank_has_the_full_state_dict(ranks: Any) -> None:
    world, _, results = ranks
    for r, res in enumerate(results):
        assert res["full_keys"] and res["full_equal"], f"rank {r}"
        assert res["distinct_storage"], f"rank {r}: tensors share a storage"
        assert res["stats_type"] == "Stats"


def test_each_rank_reads_about_a_share(ranks: Any) -> None:
    world, ckpt, results = ranks
    counts = [res["bytes_read"] for res in results]
    assert sum(counts) == ckpt["total"]
    share = ckpt["total"] / world
    for r, n in enumerate(counts):
        assert abs(n - share) <= 0.35 * share, f"rank {r} read {n} bytes, share {share:.0f}: {counts}"


def test_slice_plan_reads_only_its_ranges(ranks: Any) -> None:
    world, _, results = ranks
    for r, res in enumerate(results):
        assert res["plan_keys"] and res["plan_equal"] and res["plan_group_equal"], f"rank {r}"
        # What the handle's reads recorded (slices too), never less than the slices hold.
        assert res["plan_bytes"] >= res["plan_out_bytes"], res
        # head.bias (2 KiB) whole; big.rows: exactly its 1/world of rows; big.cols: its column
        # runs lie 1 KiB/world apart, closer than the reader's gather gap (16 KiB), so their span
        # is read in one piece: at most the whole tensor. Never the other tensors.
        whole = 256 * 256 * 4
        assert res["plan_bytes"] <= 2048 + whole / world + whole, res


def test_selection_and_ranks_needing(ranks: Any) -> None:
    world, ckpt, results = ranks
    for r, res in enumerate(results):
        assert res["selection_keys"] and res["selection_equal"], f"rank {r}"
        assert res["needing_keys"] and res["needing_equal"], f"rank {r}"
    # every selected tensor is read once, by one rank
    assert sum(res["selection_bytes"] for res in results) == ckpt["total"]


def test_failure_on_one_rank_raises_everywhere(ranks: Any) -> None:
    world, _, results = ranks
    for r, res in enumerate(results):
        assert "rank 1" in res["plan_failure"], res["plan_failure"]
        assert f"rank {world - 1}" in res["read_failure"] and "injected" in res["read_failure"], res["read_failure"]
        assert res["plan_failure_seconds"] < 20 and res["read_failure_seconds"] < 20
        assert res["after_failure_equal"], f"rank {r}: the group is not usable after a failure"


# -- planning without processes ---------------------------------------------------------------------


def test_assign_owners_contiguous_and_balanced() -> None:
    sizes = [100, 5, 5, 300, 50, 50, 200, 1, 1, 288]
    for world in (1, 2, 3, 4):
        owners = sd_dist.assign_owners(sizes, world)
        assert owners == sorted(owners) and set(owners) <= set(range(world))
        loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(world)]
        assert max(loads) - min(loads) <= max(sizes), (world, loads)


def test_assign_owners_respects_preset() -> None:
    sizes = [100] * 8
    preset = [1, -1, -1, -1, -1, -1, -1, 0]
    owners = sd_dist.assign_owners(sizes, 2, preset)
    assert owners[0] == 1 and owners[7] == 0
    free = [o for o, p in zip(owners, preset) if p < 0]
    assert free == sorted(free)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(2)]
    assert loads == [400, 400]


def test_plan_without_group_is_local(checkpoint: Dict[str, Any]) -> None:
    import safeload.torch as sl_torch

    ref = _reference(checkpoint["files"])
    plan = {"head.weight": (slice(10, 20), slice(None, None, 2))}
    got = sl_torch.load_checkpoint(checkpoint["files"], plan=plan)  # default backend (a map here)
    assert torch.equal(got["head.weight"], ref["head.weight"][10:20, ::2])
    # The parallel reader records what it reads: ten whole rows (a step within a row is cut out).
    got, stats = sl_torch.load_checkpoint(checkpoint["files"], plan=plan, backend="pread", return_stats=True)
    assert torch.equal(got["head.weight"], ref["head.weight"][10:20, ::2])
    assert 0 < stats.bytes_read <= 10 * 256 * 4
    with pytest.raises(Exception, match="does not have"):
        sl_torch.load_checkpoint(checkpoint["files"], plan={"nope": ...})
