"""A file that shrinks under an open handle (a trainer rewriting the checkpoint an evaluator is
loading): on every backend and every call, a clean ``SafetensorError`` or the bytes the file held
when it was opened; never a signal, a ``PanicException`` or other bytes.

Each case runs in a fresh process, so a signal shows as the child's exit status. The file is cut
to half its size after a handle on it is open (before the call, or between its steps: after the
first tensor a stream yields, after a loader started reading ahead); ``load_file`` and
``load_checkpoint`` open the file again after the cut, and find its header's tensors past its end. Tensors handed out before the
cut keep safetensors 0.8's behaviour (docs/backends.md) and are not touched after it here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BACKENDS = ["auto", "mmap", "pread", "direct"]
CALLS = ["get_tensor", "get_slice", "get_tensors", "prefetch_take", "load_file", "load_checkpoint",
         "iter_checkpoint"]

CHILD = r"""
import json, os, sys
import torch
import safetensors.torch as st
import safeload, safeload.torch

path, backend, call = sys.argv[1:4]
tensors = {f"t{i}": torch.arange(i * 65536, (i + 1) * 65536, dtype=torch.int32) for i in range(16)}
tensors["small"] = torch.arange(10, dtype=torch.int16)
st.save_file(tensors, path)
with open(path, "rb") as f:
    f.read()  # warm: "auto" maps a warm local file, as safetensors' default does

def cut():
    os.truncate(path, os.path.getsize(path) // 2)

got = {}
def keep(name, tensor):
    got[name] = tensor.clone()  # touches every byte now, as a user's model would

try:
    if call in ("load_file", "load_checkpoint", "iter_checkpoint"):
        if call == "load_file":
            cut()
            for k, v in safeload.torch.load_file(path, backend=backend).items():
                keep(k, v)
        elif call == "load_checkpoint":
            with safeload.safe_open(path, "pt", backend=backend) as f:  # open, cut, load
                cut()
                for k, v in safeload.torch.load_checkpoint(path, backend=backend).items():
                    keep(k, v)
        else:
            for i, (k, v) in enumerate(safeload.torch.iter_checkpoint(path, backend=backend,
                                                                max_inflight_bytes=1 << 18)):
                keep(k, v)
                if i == 0:
                    cut()
    else:
        with safeload.safe_open(path, "pt", backend=backend) as f:
            names = f.offset_keys()
            if call == "prefetch_take":
                loader = f.prefetch()
                cut()
                for k in reversed(names):
                    keep(k, loader.take(k))
            else:
                cut()
                if call == "get_tensor":
                    for k in names:
                        keep(k, f.get_tensor(k))
                elif call == "get_slice":
                    for k in names:
                        keep(k, f.get_slice(k)[1:])
                else:
                    for k, v in f.get_tensors().items():
                        keep(k, v)
    outcome = "ok"
except safeload.SafetensorError as e:
    outcome = "error: " + str(e)
for k, v in got.items():  # what was returned must be what the file held
    want = tensors[k][1:] if call == "get_slice" else tensors[k]
    if not torch.equal(v, want):
        outcome = "wrong bytes: " + k
        break
print(json.dumps({"outcome": outcome, "returned": len(got)}))
"""


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_file_shrinking_under_a_handle_is_an_error_or_its_bytes(tmp_path, backend, call):
    path = tmp_path / "shrinking.safetensors"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), backend, call],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    outcome = result["outcome"]
    assert not outcome.startswith("wrong bytes"), outcome
    if outcome.startswith("error"):
        assert str(path) in outcome, outcome  # names the file
        opened_after_the_cut = call in ("load_file", "load_checkpoint")
        assert ("shrank" in outcome or "ended early" in outcome
                or opened_after_the_cut and "not fully covered" in outcome), outcome
    else:
        assert result["returned"] == 17, result  # every tensor, each the file's bytes
