#!/usr/bin/env python3
"""One check for a machine with a CUDA GPU: safeload's staged CUDA load against safetensors 0.8.

    python benches/gpu_check.py                      # ~2.5 GiB bf16 Llama-shaped checkpoint
    python benches/gpu_check.py --size small         # ~190 MiB
    python benches/gpu_check.py --rounds 5 --ring 4x64MiB --device cuda:0
    python benches/gpu_check.py --self-check --size small   # no GPU: the staging loader through
                                                            # a deferring CPU sink, byte for byte

Saving too: the checkpoint's tensors on the device written back by ``safeload.torch.save_file``
(through the pinned staging ring) and by 0.8's, equal byte for byte, each timed until synced.

Writes a sample checkpoint (with safetensors 0.8's writer; reused when already there), checks that
``safeload.torch.load_file(path, device=...)`` (and ``load_checkpoint``) give exactly the bytes,
dtypes and shapes of ``safetensors.torch.load_file(path, device=...)``, then prints a markdown
table of load rates (median and best of ``--rounds``, page cache warm): safeload to CUDA,
safetensors 0.8 to CUDA, pinned host-to-device copies alone, the engine's read into the staging
ring alone, and safeload's warm CPU read, with ratios, the byte-equality result and the peak pinned
staging bytes. Exits 1 when bytes differ or pinned staging exceeds the ring plus one chunk, 2 when
the machine has no CUDA device (a clear message, no traceback).

It times the engine's read into the staging ring with the ring's own planner, a test helper: run
it on an install built with the `testing` feature (what `.ci/run` installs:
``pip install -e '.[test]' --config-settings=build-args='--features python,testing'``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

try:
    import safeload
except ImportError:  # not installed: use the package in this checkout (python/safeload)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import safeload

import torch

import safetensors
import safetensors.torch as st_torch

import safeload.torch as sl_torch
from safeload import _checkpoint, _safeload, _staging
from safeload._safeload import DEFAULT_CHUNK_BYTES, Handle

# The staging ring's plain-memory test double, for the self-check without a GPU.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support"))
from cpu_sink import CpuSink  # noqa: E402

GiB = 2**30

# Llama-shaped: (hidden, intermediate, layers, vocab, kv heads, head dim)
SIZES = {
    "full": (2048, 5632, 28, 32000, 4, 64),  # ~2.5 GiB in bf16 (TinyLlama-like, 28 layers)
    "small": (1024, 2816, 6, 16000, 4, 64),  # ~190 MiB
    "tiny": (128, 352, 2, 1000, 2, 32),  # ~1 MiB (quick self-checks)
}


def spec_tensors(size: str):
    """(name, dtype, shape) of the sample checkpoint, plus odd tensors (scalar, empty, odd sizes,
    fp8) that the staging plan must handle."""
    hidden, inter, layers, vocab, kv, hd = SIZES[size]
    bf = torch.bfloat16
    out = [("model.embed_tokens.weight", bf, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", bf, (hidden,)),
            (p + "self_attn.q_proj.weight", bf, (hidden, hidden)),
            (p + "self_attn.k_proj.weight", bf, (kv * hd, hidden)),
            (p + "self_attn.v_proj.weight", bf, (kv * hd, hidden)),
            (p + "self_attn.o_proj.weight", bf, (hidden, hidden)),
            (p + "post_attention_layernorm.weight", bf, (hidden,)),
            (p + "mlp.gate_proj.weight", bf, (inter, hidden)),
            (p + "mlp.up_proj.weight", bf, (inter, hidden)),
            (p + "mlp.down_proj.weight", bf, (hidden, inter)),
        ]
    out += [
        ("model.norm.weight", bf, (hidden,)),
        ("lm_head.weight", bf, (vocab, hidden)),
        ("extra.scalar_f32", torch.float32, ()),
        ("extra.empty_bf16", bf, (0, hidden)),
        ("extra.odd_u8", torch.uint8, (12345,)),
        ("extra.odd_f16", torch.float16, (7, 13, 3)),
        ("extra.fp8", torch.float8_e4m3fn, (333, 17)),
    ]
    return out


def write_sample(path: str, size: str) -> int:
    """Writes (or reuses) the sample; returns its data bytes."""
    spec = spec_tensors(size)
    tag = f"{size}:{len(spec)}:v1"
    if os.path.exists(path):
        try:
            with safetensors.safe_open(path, "pt") as f:
                if (f.metadata() or {}).get("gpu_check") == tag:
                    return sum(_nbytes(d, s) for _, d, s in spec)
        except Exception:  # noqa: BLE001 - rewrite anything unreadable
            pass
    print(f"writing {path} ({size}) ...", flush=True)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, dtype, shape in spec:
        n = _numel(shape)
        raw = torch.randint(-(2**15), 2**15, (n * dtype.itemsize // 2 + 1,), generator=g, dtype=torch.int16)
        tensors[name] = raw.view(torch.uint8)[: n * dtype.itemsize].view(dtype).reshape(shape).clone()
    tmp = path + ".tmp"
    st_torch.save_file(tensors, tmp, metadata={"gpu_check": tag})
    os.replace(tmp, path)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _nbytes(dtype, shape) -> int:
    return _numel(shape) * dtype.itemsize


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)[:0].view(torch.uint8)


def compare(got: dict, ref: dict, device) -> list:
    """Differences between two state dicts (keys, dtypes, shapes, devices, bytes)."""
    problems = []
    if sorted(got) != sorted(ref):
        problems.append(f"keys differ: {sorted(set(got) ^ set(ref))[:5]}")
    for k in sorted(set(got) & set(ref)):
        a, b = got[k], ref[k]
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            problems.append(f"{k}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
        elif device is not None and a.device != b.device:
            problems.append(f"{k}: on {a.device}, safetensors on {b.device}")
        elif not torch.equal(_bytes_of(a), _bytes_of(b.to(a.device))):
            problems.append(f"{k}: bytes differ")
    return problems


def timed(fn, rounds: int, sync) -> list:
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        sync()
        seconds.append(time.perf_counter() - t0)
        del out
    return seconds


def row(what: str, nbytes: int, seconds: list, base: float = 0.0) -> tuple:
    med = nbytes / statistics.median(seconds) / GiB
    best = nbytes / min(seconds) / GiB
    ratio = f"{med / base:.2f}x" if base else "-"
    return what, f"{med:.2f}", f"{best:.2f}", ratio


def print_table(title: str, rows: list, extra: list) -> None:
    print(f"\n### {title}\n")
    print("| measure | GiB/s (median) | GiB/s (best) | vs safetensors 0.8 |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()
    print("| check | result |")
    print("|---|---|")
    for k, v in extra:
        print(f"| {k} | {v} |")
    print(flush=True)


def self_check(path: str, nbytes: int, ring: tuple, rounds: int) -> int:
    """No GPU: the staging loader through a deferring CPU sink (asynchronous copies simulated),
    against safetensors 0.8's CPU load, byte for byte."""
    n, b = ring
    ref = st_torch.load_file(path)
    problems = []
    seconds = []
    peak = 0
    for _ in range(rounds):
        sink = CpuSink(defer=True)
        t0 = time.perf_counter()
        got, stats = _staging.load_to_device(path, None, sink=sink, ring_buffers=n, buffer_bytes=b)
        seconds.append(time.perf_counter() - t0)
        problems += compare(got, ref, None)
        peak = max(peak, stats.staging_bytes, stats.peak_in_flight)
        # A ring buffer is never refilled before its previous copies completed.
        slot_of, done = {}, set()
        for e in sink.log:
            if e[0] == "fill":
                prev = slot_of.get(e[2])
                if prev is not None and prev not in done:
                    problems.append(f"fill {e[1]} reused buffer {e[2]} before fill {prev} completed")
                slot_of[e[2]] = e[1]
            elif e[0] == "complete":
                done.add(e[1])
        del got
    limit = n * b + DEFAULT_CHUNK_BYTES
    save_rows, save_checks, save_ok = save_check(ref, os.path.dirname(path), rounds, sink=CpuSink(defer=True))
    ok = not problems and peak <= limit and save_ok
    print_table(
        f"safeload staging self-check (CPU sink, no GPU): {nbytes / GiB:.2f} GiB, ring {n}x{_size(b)}",
        [row("safeload staged load, deferring CPU sink", nbytes, seconds), *save_rows],
        [("bytes equal to safetensors 0.8 (CPU)", "yes" if not problems else f"NO: {problems[:3]}"),
         ("peak staging bytes", f"{peak} (limit {limit} = ring + one chunk)"), *save_checks,
         ("result", "PASS" if ok else "FAIL")],
    )
    return 0 if ok else 1


def save_check(sd: dict, folder: str, rounds: int, sink=None) -> tuple:
    """Saving ``sd`` (on the device, or on the CPU through ``sink``, the stand-in): safeload's file
    equal to 0.8's byte for byte, its manifest digest right; each writer timed until synced.
    Returns (rows, checks)."""
    import hashlib

    from safeload import _save

    ours, ref = os.path.join(folder, "safeload_gpu_save.safetensors"), os.path.join(folder, "st_gpu_save.safetensors")
    nbytes = sum(t.nelement() * t.element_size() for t in sd.values())

    def st_save():
        st_torch.save_file(sd, ref, metadata={"format": "pt"})
        fd = os.open(ref, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def sl_save(manifest=False):
        if sink is None:
            return sl_torch.save_file(sd, ours, metadata={"format": "pt"}, fsync=True, manifest=manifest)
        digests = _save.write_staged([(sd, ours, {"format": "pt"})], sink, fsync=True, hash=manifest)
        if manifest:
            _save.record_digests(folder, {os.path.basename(ours): digests[0]})

    st_save()
    sl_save(manifest=True)
    with open(ours, "rb") as a, open(ref, "rb") as b:
        data = a.read()
        same = data == b.read()
    listed = _safeload.read_manifest(os.path.join(folder, "SHA256SUMS"))
    digest_ok = dict(listed).get(os.path.basename(ours)) == hashlib.sha256(data).hexdigest()
    t_st, t_sl = timed(st_save, rounds, lambda: None), timed(sl_save, rounds, lambda: None)
    base = nbytes / statistics.median(t_st) / GiB
    where = "CUDA, staged" if sink is None else "CPU sink stand-in"
    rows = [row(f"safeload save_file(fsync=True) ({where})", nbytes, t_sl, base),
            row("safetensors 0.8 save_file + fsync", nbytes, t_st, base)]
    checks = [("saved file equal to 0.8's, byte for byte", "yes" if same else "NO"),
              ("SHA256SUMS digest of the bytes written", "yes" if digest_ok else "NO")]
    for f in (ours, ref, os.path.join(folder, "SHA256SUMS")):
        os.unlink(f)
    return rows, checks, same and digest_ok


def prefetch_all(path: str, device: str) -> dict:
    """safetensors 0.9's API through safeload: prefetch onto the device, take every tensor."""
    with safeload.safe_open(path, "pt") as f:
        with f.prefetch(device=device) as loader:
            return dict(loader)


def st_loop(path: str, device: str) -> dict:
    """safetensors 0.8's per-tensor CUDA path: get_tensor(k) on a device handle."""
    with safetensors.safe_open(path, "pt", device=device) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def gpu_check(path: str, nbytes: int, ring: tuple, rounds: int, device: str) -> int:
    n, b = ring
    dev = torch.device(device)
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    os.environ[_staging.RING_ENV] = f"{n}x{b}"

    # Warm the page cache, CUDA context and caching allocators.
    sl_torch.load_file(path, backend="pread")
    st_torch.load_file(path, device=device)
    sync()

    # -- correctness ----------------------------------------------------------------------------
    ref = st_torch.load_file(path, device=device)
    got = sl_torch.load_file(path, device=device)
    sync()
    problems = compare(got, ref, dev)
    with safeload.safe_open(path, "pt", device=device) as f:
        problems += [f"get_tensors: {p}" for p in compare(f.get_tensors(), ref, dev)]
        stats = f.staging_stats  # what the staged load did: ring, pinned bytes
    ckpt = _checkpoint.load_checkpoint(path, "pt", device=device)
    problems += [f"load_checkpoint: {p}" for p in compare(ckpt, ref, dev)]
    with safeload.safe_open(path, "pt", device=device) as f:
        for k in list(ref)[:3] + ["extra.scalar_f32", "extra.empty_bf16", "extra.fp8"]:
            problems += [f"get_tensor: {p}" for p in compare({k: f.get_tensor(k)}, {k: ref[k]}, dev)]
    problems += [f"prefetch: {p}" for p in compare(prefetch_all(path, device), ref, dev)]
    del got, ref, ckpt
    torch.cuda.empty_cache()
    pinned = stats.pinned_bytes if stats else -1
    limit = n * b + DEFAULT_CHUNK_BYTES

    # -- rates ------------------------------------------------------------------------------------
    t_st = timed(lambda: st_torch.load_file(path, device=device), rounds, sync)
    t_sl = timed(lambda: sl_torch.load_file(path, device=device), rounds, sync)
    t_pf = timed(lambda: prefetch_all(path, device), rounds, sync)
    t_st_loop = timed(lambda: st_loop(path, device), rounds, sync)
    peak_pinned = pinned  # every staged load here uses the same ring

    # Pinned host-to-device copies alone: the bytes of the checkpoint, buffer by buffer.
    src = torch.empty(min(b, nbytes), dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(device=dev)

    def h2d():
        with torch.cuda.stream(stream):
            for at in range(0, nbytes, src.numel()):
                k = min(src.numel(), nbytes - at)
                dst[at : at + k].copy_(src[:k], non_blocking=True)
        stream.synchronize()

    h2d()
    t_h2d = timed(h2d, rounds, sync)
    dst = None  # frees the device copy

    # The engine's read into the pinned ring alone (no device copies).
    ring_bufs = [torch.empty(min(b, nbytes), dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    handle = Handle(path, "pread")
    fills = _safeload._testing.staging_fills([(i.name, i.begin, i.end) for i in handle.infos()], b)

    def staged_read():
        for i, fill in enumerate(fills):
            buf = ring_bufs[i % n]
            handle.read_ranges([(buf[at : at + length], offset) for offset, length, at in fill.reads])

    t_read_ring = timed(staged_read, rounds, lambda: None)
    handle.close()
    ring_bufs = src = None  # frees the pinned buffers
    t_cpu = timed(lambda: sl_torch.load_file(path, backend="pread"), rounds, lambda: None)
    save_rows, save_checks, save_ok = save_check(st_torch.load_file(path, device=device), os.path.dirname(path),
                                                 rounds)

    base = nbytes / statistics.median(t_st) / GiB
    rows = [
        row(f"safeload -> {device} (staged, ring {n}x{_size(b)})", nbytes, t_sl, base),
        row(f"safetensors 0.8 -> {device}", nbytes, t_st, base),
        row(f"safeload prefetch(device={device}) + take all (0.9 API, pinned staging)", nbytes, t_pf, base),
        row(f"safetensors 0.8 safe_open(device={device}).get_tensor loop", nbytes, t_st_loop, base),
        row("pinned H2D copies alone", nbytes, t_h2d, base),
        row("engine read into pinned ring alone (warm)", nbytes, t_read_ring, base),
        row("safeload CPU load, pread (warm)", nbytes, t_cpu, base),
        *save_rows,  # "vs 0.8" of these two: against 0.8's save
    ]
    host = {}
    try:
        host = {k: v for k, v in torch.cuda.host_memory_stats().items() if "peak" in k and "bytes" in k}
    except Exception:  # noqa: BLE001 - informational only
        pass
    ok_bytes = not problems
    ok_pinned = 0 <= peak_pinned <= limit
    extra = [
        ("bytes equal to safetensors 0.8 (load_file, load_checkpoint, get_tensor)",
         "yes" if ok_bytes else f"NO ({len(problems)}): {problems[:5]}"),
        ("peak pinned staging bytes (safeload)", f"{peak_pinned} (limit {limit} = ring + one chunk)"),
        ("fills / tensors per load", f"{stats.fills} / {stats.tensors}" if stats else "-"),
        ("torch host allocator peaks (all pinned use in the process)", str(host) if host else "n/a"),
        ("GPU", torch.cuda.get_device_name(dev)),
        ("versions", f"safeload {safeload.__version__}, safetensors {safetensors.__version__}, "
                     f"torch {torch.__version__}"),
        *save_checks,
        ("result", "PASS" if ok_bytes and ok_pinned and save_ok else "FAIL"),
    ]
    print_table(f"CUDA load of {nbytes / GiB:.2f} GiB ({os.path.basename(path)}), {rounds} rounds",
                rows, extra)
    return 0 if ok_bytes and ok_pinned and save_ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benches/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full",
                        help="full: ~2.5 GiB bf16 Llama-shaped; small: ~190 MiB; tiny: ~1 MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ring", default="4x64MiB", help="staging ring COUNTxSIZE (default 4x64MiB)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the sample is written")
    parser.add_argument("--self-check", action="store_true",
                        help="no GPU needed: the staging loader through a deferring CPU sink")
    args = parser.parse_args(argv)
    if not hasattr(_safeload, "_testing"):
        parser.error("needs safeload built with the testing feature: pip install -e '.[test]' "
                     "--config-settings=build-args='--features python,testing'")
    try:
        ring = _safeload._testing.parse_ring(args.ring)
    except ValueError as e:
        parser.error(str(e))
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not args.self_check:
        if not torch.cuda.is_available():
            print(f"gpu_check: needs a CUDA device, and torch {torch.__version__} sees none "
                  "(torch.cuda.is_available() is False). Nothing was measured. "
                  "Run with --self-check to check the staging loader through a CPU sink.",
                  file=sys.stderr)
            return 2
        try:
            from safeload import _device
            _device.torch_device(_device.parse(args.device))
        except Exception as e:  # noqa: BLE001
            print(f"gpu_check: {e}", file=sys.stderr)
            return 2
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"safeload_gpu_check_{args.size}.safetensors")
    nbytes = write_sample(path, args.size)
    if args.self_check:
        return self_check(path, nbytes, ring, args.rounds)
    return gpu_check(path, nbytes, ring, args.rounds, args.device)


if __name__ == "__main__":
    sys.exit(main())
