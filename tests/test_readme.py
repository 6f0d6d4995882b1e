"""Every ```python block of README.md runs, in a directory holding the files the examples name:
model.safetensors (with lm_head.weight) and checkpoint/ (three shards and an index)."""

import json
import logging
import os
import re
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    st.save_file({"lm_head.weight": torch.randn(2048, 16), "embed.weight": torch.randn(100, 16)}, tmp_path / "model.safetensors")
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    weight_map = {}
    for i in range(3):
        name = f"model-0000{i + 1}-of-00003.safetensors"
        tensors = {f"layer{i}.w": torch.randn(64, 64), f"layer{i}.b": torch.randn(64)}
        st.save_file(tensors, ckpt / name)
        weight_map.update({k: name for k in tensors})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    handlers = list(root.handlers)
    yield tmp_path
    # Examples configure logging; leave the process as it was.
    logging.getLogger("safeload").setLevel(logging.NOTSET)
    root.handlers[:] = handlers


def test_readme_has_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(workdir, index):
    code = BLOCKS[index]
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": f"readme_{index}"})
    assert os.getcwd() == str(workdir)
