"""Progress of multi-shard loads: a tqdm bar on a terminal or with progress=True, silent otherwise."""

import fcntl
import os
import pty
import subprocess
import struct
import sys
import termios
import threading

import pytest
import safetensors.torch as st
import torch

import safeload.torch as sl

pytest.importorskip("tqdm")

LOAD = "import sys, safeload.torch as sl; sl.load_checkpoint(sys.argv[1]); print('done', flush=True)"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    for i in range(3):
        st.save_file({f"w{i}": torch.zeros(1 << 20)}, root / f"model-0000{i + 1}-of-00003.safetensors")
    return root


def test_silent_when_stderr_is_not_a_terminal(shards, capfd):
    got = sl.load_checkpoint(shards)
    assert set(got) == {"w0", "w1", "w2"}
    assert capfd.readouterr().err == ""


def test_bar_when_asked(shards, capfd):
    seen = []
    sl.load_checkpoint(shards, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1][0] == seen[-1][1] == 3 * (4 << 20)
    sl.load_checkpoint(shards, progress=True)
    err = capfd.readouterr().err
    assert "loading" in err and "12.0M" in err


def test_bar_on_a_terminal_by_default(shards):
    parent, child = pty.openpty()
    # A fresh pty is 0 columns wide, which tqdm would honour with an empty bar.
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks = []

    def drain():
        while True:
            try:
                data = os.read(parent, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    proc = subprocess.Popen([sys.executable, "-c", LOAD, str(shards)], stdout=subprocess.PIPE, stderr=child)
    os.close(child)
    out, _ = proc.communicate(timeout=60)
    reader.join(timeout=10)
    os.close(parent)
    assert out.strip() == b"done"
    assert b"loading" in b"".join(chunks)
