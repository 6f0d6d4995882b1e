"""Tensor-parallel loads as users run them: unmodified transformers ``from_pretrained(...,
tp_plan="auto")``, 2 gloo ranks on the CPU under ``python -m torch.distributed.run``, stock
(safetensors 0.8) and through ``SAFELOAD_PATCH=1`` (the startup hook, nothing else set).

Each rank loads its own copy of a tiny Llama checkpoint (as ranks on separate nodes do: no page
cache shared), cold: written, synced and evicted (``POSIX_FADV_DONTNEED``) before the patched run.
The ranks' parameters and logits must equal stock's; safeload's own count of the bytes each rank
read from each file (the close record of its DEBUG log) must stay within the pages that rank's
slices touch plus the file's header; and so must what the kernel read (the file's pages in the
page cache after the load, ``mincore``), within 10%. The pages are worked out here from the header
and the slices transformers asked (recorded by a spy on ``SafeSlice.__getitem__``), with no
safeload code. A read-ahead that read the other rank's rows (into memory of its own or into the
page cache), a map left to the kernel's read-around, or a column split read as whole rows where
that crosses untouched pages, fails it. No timing is asserted.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "support"))

from tp_rank import evict, header, run_ranks, touched_pages  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A Llama checkpoint saved by transformers in 5 shards, one copy per rank. The MLP's
    intermediate size (688) makes ``down_proj``'s column split runs that do not fall on page
    boundaries; ``o_proj``'s runs are a quarter page."""
    pytest.importorskip("accelerate", reason="transformers' tp_plan needs accelerate")
    transformers = pytest.importorskip("transformers")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                   tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("tp")
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "copy0", max_shard_size="1MB")
    shutil.copytree(root / "copy0", root / "copy1")
    return root


def test_each_rank_reads_the_pages_of_its_slices(fresh_env, tiny_llama, tmp_path):
    env = {**fresh_env["env"], "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    model = str(tiny_llama / "copy{rank}")
    run_ranks(fresh_env["python"], env, model, tmp_path / "stock")
    for k in range(2):
        evict(tiny_llama / f"copy{k}")
    patched = run_ranks(fresh_env["python"], {**env, "SAFELOAD_PATCH": "1"}, model, tmp_path / "patch", "--spy")

    for rank, got in enumerate(patched):
        stock = torch.load(tmp_path / "stock" / f"rank{rank}.pt")
        ours = torch.load(tmp_path / "patch" / f"rank{rank}.pt")
        assert stock["params"].keys() == ours["params"].keys()
        for name, value in stock["params"].items():
            assert torch.equal(value, ours["params"][name]), (rank, name)
        assert torch.equal(stock["logits"], ours["logits"]), rank

        asked = got["asked"]
        assert asked, "transformers read no slice through safeload: the patch is not in"
        files = {r["path"]: r for r in got["reads"]}
        assert set(files) == {str(p) for p in (tiny_llama / f"copy{rank}").glob("*.safetensors")}
        pages = {path: set() for path in files}
        headers = {path: header(path) for path in files}
        for a in asked:
            pages[a["path"]] |= touched_pages(a["path"], a["name"], a["key"], known=headers[a["path"]])
        for path, read in files.items():
            # transformers asks for "mmap": the parts are views of the map, as 0.8's, and the
            # pages they touch are asked of the kernel as they are handed out (counted as read;
            # none would be, had the file been found resident).
            assert read["backend"] == "mmap", (rank, path, read)
            bound = len(pages[path]) * 4096 + headers[path][0]
            assert 0 < read["bytes_read"] <= bound, (rank, path, read["bytes_read"], bound)
            # What the kernel read: the pages now cached, the file having been evicted before.
            # The header's own read may read a few pages ahead (before safeload knows the file
            # is read by slices); nothing else may be there.
            head = set(range((headers[path][0] - 1) // 4096 + 1))
            wanted = pages[path] | head
            extra = set(got["resident"][path]) - wanted
            assert len(extra) <= 0.10 * len(wanted), (rank, path, sorted(extra)[:20], len(wanted))
        # Each rank needs about half of every weight: far less than the files.
        total = sum(os.path.getsize(p) for p in files)
        assert sum(r["bytes_read"] for r in files.values()) < 0.8 * total
