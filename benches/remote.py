"""Loading checkpoints from object storage, every server started here on loopback: safeload from
``s3://`` (``rclone serve s3``) and ``http://`` (tests/support/range_server.py, with and without
added latency per request) against boto3 ``get_object`` / urllib + ``safetensors.torch.load``,
Run:ai's streamer (when installed; the tensors it hands over kept), safetensors 0.8
(``st_fuse``) and safeload (``sl_fuse``) reading the same object through a FUSE mount of the
bucket (``rclone mount``, where fusermount3 is installed), and many parallel raw range GETs by
``curl --parallel`` (the server's own limit). ``sl_s3_again`` / ``sl_http_again`` time the second
of two loads in one process, into memory the first freed: their gap to ``sl_s3`` / ``sl_http``
is what faulting fresh memory in costs. ``sl_hub`` loads ``hf://`` from a loopback Hub
(range_server's Hub emulation under ``HF_ENDPOINT``, redirecting each ``resolve`` URL to the HTTP
server as its storage, both with the added latency). ``sl_s3_verify`` / ``sl_http_verify`` /
``sl_hub_verify`` are the same loads with ``verify=``: the file's SHA-256 (hashlib's, computed
here before any clock) pinned by name, and for the Hub ``verify=True``, the SHA-256 its
``X-Linked-Etag`` reports; a second table gives each store's ratio of verified to plain load
time (issue 54: within 1.15x where the network is the limit). Fresh processes, contenders
interleaved (the order rotating each round, after one untimed read of each file warms the
servers and the page cache), medians of ``--rounds``; peak RSS beside each rate.

    python benches/remote.py [--sizes 0.5,2.5] [--rounds 3] [--latency 0,0.005] [--contenders 'sl_*,boto3']

0.5: a Llama-shaped BF16 sample written to --data-dir; 2.5: --full (default
/work/main/bench-data/full/llama/model.safetensors, read only). The files are served through
symlinks; nothing is written next to them.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))
sys.path.insert(0, HERE)
GIB = 1 << 30
CHUNK = 16 << 20
PARALLEL = 32
S3_SIDE = ("sl_s3", "sl_s3_again", "sl_s3_verify", "boto3", "curl_s3", "runai", "st_fuse", "sl_fuse")
HUB_REPO = "hub/bench"  # the loopback Hub's repository: ROOT/hub/bench/resolve/main/<size>.safetensors


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _load(spec: Dict[str, Any]) -> int:
    """One load of the contender; returns the bytes of tensor data it holds."""
    name, url, s3 = spec["contender"], spec["url"], spec["s3"]
    if name.startswith("sl_"):
        import safeload

        os.environ.update(spec.get("env", {}))  # HF_ENDPOINT: the loopback Hub
        options = s3["options"] if url.startswith("s3://") else None
        tuning = {"threads": spec.get("threads"), "chunk_bytes": spec.get("chunk_bytes")}
        verify = spec.get("verify", False)  # False, not None: $SAFELOAD_VERIFY cannot turn it on
        with safeload.safe_open(url, "pt", storage_options=options, verify=verify, **tuning) as f:
            out = f.get_tensors()
            if bool(verify) != (f.stats.verified_files == 1):  # a verified row is a verified load
                raise SystemExit(f"{name}: {f.stats.verified_files} files verified, verify={verify!r}")
        return sum(t.nbytes for t in out.values())
    if name in ("st_fuse", "sl_fuse"):  # the object as a file of the mount, every page touched
        from bench import _touch

        if name == "st_fuse":
            import safetensors.torch as loader
        else:
            import safeload.torch as loader  # type: ignore[no-redef]
        out = loader.load_file(spec["fuse_path"])
        _touch(out)  # 0.8's default maps the file: its reads happen at the touches
        return sum(t.nbytes for t in out.values())
    if name == "boto3":
        import boto3
        import safetensors.torch

        client = boto3.client("s3", endpoint_url=s3["endpoint"], aws_access_key_id=s3["key"],
                              aws_secret_access_key=s3["secret"], region_name="us-east-1")
        bucket, key = url[len("s3://"):].split("/", 1)
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        out = safetensors.torch.load(data)
        return sum(t.nbytes for t in out.values())
    if name == "urllib":
        import urllib.request

        import safetensors.torch

        with urllib.request.urlopen(url) as r:
            out = safetensors.torch.load(r.read())
        return sum(t.nbytes for t in out.values())
    if name == "runai":
        from runai_model_streamer import SafetensorsStreamer

        os.environ.update({"AWS_ENDPOINT_URL": s3["endpoint"], "AWS_ACCESS_KEY_ID": s3["key"],
                           "AWS_SECRET_ACCESS_KEY": s3["secret"], "AWS_REGION": "us-east-1",
                           "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"})
        with SafetensorsStreamer() as streamer:  # owned=True (0.17's default): the caller keeps
            streamer.stream_file(url)  # each tensor it is given, no copy needed
            out = dict(streamer.get_tensors())
        return sum(t.nbytes for t in out.values())
    if name == "curl":  # the server's limit: parallel range GETs into /dev/null
        size = spec["size"]
        each = ["-sf"]
        if url.startswith("s3://"):
            each += ["--aws-sigv4", "aws:amz:us-east-1:s3", "--user", f"{s3['key']}:{s3['secret']}"]
            url = f"{s3['endpoint']}/{url[len('s3://'):]}"
        cmd = ["curl", "--parallel", "--parallel-max", str(PARALLEL)]
        for begin in range(0, size, CHUNK):  # --next: options apply per transfer
            cmd += [*each, "-r", f"{begin}-{min(size, begin + CHUNK) - 1}", "-o", "/dev/null", url, "--next"]
        cmd.pop()
        subprocess.run(cmd, check=True)
        return size
    raise SystemExit(f"unknown contender {name}")


def worker(arg: str) -> None:
    spec = json.loads(arg)
    import torch  # noqa: F401  (every contender but curl holds torch; its import is not the load's memory)

    if spec["contender"].endswith("_again"):  # the second load of a process: memory reused
        spec = {**spec, "contender": spec["contender"][: -len("_again")]}
        _load(spec)  # untimed; what it held is freed (safeload's pool keeps it for the next load)
    before = _maxrss_mib()
    t0 = time.perf_counter()
    nbytes = _load(spec)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "bytes": nbytes, "rss_mib": _maxrss_mib(), "rss_growth_mib": _maxrss_mib() - before}))


def serve_hub(arg: str) -> None:
    """The loopback Hub: range_server answering each request with a redirect to its storage, in a
    process of its own. Not a thread of the parent: the Hub reads each file whole to hash it for
    its headers, and every worker would inherit that peak as its own (ru_maxrss survives exec)."""
    from range_server import RangeServer

    spec = json.loads(arg)
    hub = RangeServer(spec["root"])
    hub.latency, hub.redirect_to = spec["latency"], spec["storage"]
    print(hub.url, flush=True)
    hub.serve_forever()


class RcloneMount:
    """``rclone mount`` of the S3 server's bucket ``bench`` (read only, rclone's defaults:
    no VFS cache, chunked range reads), where the OS has fusermount3."""

    def __init__(self, s3: Dict[str, Any]) -> None:
        from s3_server import rclone

        binary = rclone()
        if binary is None or shutil.which("fusermount3") is None:
            raise RuntimeError("needs rclone and fusermount3 (apt-get install fuse3)")
        self.path = tempfile.mkdtemp(prefix="safeload-rclone-mount-")
        remote = (f":s3,provider=Other,endpoint='{s3['endpoint']}',access_key_id={s3['key']},"
                  f"secret_access_key={s3['secret']},force_path_style=true:bench")
        self.proc = subprocess.Popen([binary, "mount", remote, self.path, "--read-only"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("rclone mount did not come up")
            time.sleep(0.1)

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", self.path], capture_output=True)
        self.proc.terminate()
        self.proc.wait()
        os.rmdir(self.path)


def _sample(data_dir: str) -> str:
    """The 0.5 GiB Llama-shaped BF16 sample (written once)."""
    path = os.path.join(data_dir, "llama-0.5.safetensors")
    if not os.path.exists(path):
        from bench import _llama_like, _save, _tiles

        os.makedirs(data_dir, exist_ok=True)
        _save(_llama_like(1024, 2816, 16, 32000), path, _tiles(), seed0=1)
    return path


def _sha256(path: str) -> str:
    """hashlib's SHA-256 of the file (the pin of the ``*_verify`` contenders; Python 3.9 has no
    ``hashlib.file_digest``)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _warm_hub(url: str) -> None:
    """One ranged GET of a ``resolve`` URL, redirect followed: the Hub and its storage each hash
    the file once for the headers they send, before any load's parallel requests (which would
    each hash it) and outside any clock."""
    request = urllib.request.Request(url, headers={"Range": "bytes=0-0"})
    with urllib.request.urlopen(request) as r:
        if r.headers.get("X-Linked-Etag") is None:
            raise SystemExit(f"{url}: the loopback Hub sent no X-Linked-Etag")
        r.read()


def _hub_and_verify(name: str, size: str, sha256: Optional[str], hub_url: Optional[str]) -> Dict[str, Any]:
    """What a contender's spec adds: the ``hf://`` URL of the loopback Hub and its
    ``HF_ENDPOINT`` (``sl_hub*``), and ``verify=`` (``*_verify``): for the Hub, the digest it
    reports (True); elsewhere the file's, pinned by name."""
    extra: Dict[str, Any] = {}
    if name.startswith("sl_hub"):
        extra.update(url=f"hf://{HUB_REPO}/{size}.safetensors", env={"HF_ENDPOINT": hub_url})
    if name.endswith("_verify"):
        extra["verify"] = True if name.startswith("sl_hub") else {f"{size}.safetensors": sha256}
    return extra


def _verify_ratios(rows: Dict[tuple, List[Dict[str, Any]]], file_gib: Dict[str, float]) -> None:
    """Each store's verified load against its plain one: median seconds, their ratio, peak RSS."""
    print()
    print("| file | added latency | store | load s | `verify=` s | ratio | peak RSS load / `verify=` MiB |")
    print("|---|---|---|---|---|---|---|")
    for (size, latency, name), verified in rows.items():
        if not name.endswith("_verify") or (size, latency, name[: -len("_verify")]) not in rows:
            continue
        plain = rows[(size, latency, name[: -len("_verify")])]
        seconds = [statistics.median(x["seconds"] for x in r) for r in (plain, verified)]
        rss = [statistics.median(x["rss_mib"] for x in r) for r in (plain, verified)]
        lat = latency if latency == "-" else f"{float(latency) * 1000:.0f} ms"
        store = name[len("sl_"): -len("_verify")]
        print(f"| {file_gib[size]:.2f} GiB | {lat} | {store} | {seconds[0]:.3f} | {seconds[1]:.3f} | "
              f"{seconds[1] / seconds[0]:.2f} | {rss[0]:.0f} / {rss[1]:.0f} |")


def _data_bytes(path: str) -> int:
    """The bytes of tensor data in a safetensors file (what every loading contender must hold)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(end - begin for k, v in header.items() if k != "__metadata__" for begin, end in [v["data_offsets"]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.5,2.5")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--latency", default="0,0.005", help="seconds added per request by the HTTP server")
    p.add_argument("--contenders", default="*")
    p.add_argument("--data-dir", default=os.path.join(HERE, "..", "bench-data", "remote"))
    p.add_argument("--full", default="/work/main/bench-data/full/llama/model.safetensors")
    p.add_argument("--sweep", action="store_true", help="safeload only: threads 16/32/64 x chunks 8/16/32 MiB")
    p.add_argument("--worker")
    p.add_argument("--hub", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.hub:
        return serve_hub(args.hub)

    from range_server import __file__ as range_server_py
    from s3_server import KEY, SECRET, S3Server

    sizes = args.sizes.split(",")
    if not set(sizes) <= {"0.5", "2.5"}:
        raise SystemExit(f"--sizes: {args.sizes!r}, not a list of 0.5 and 2.5")
    files = {size: _sample(args.data_dir) if size == "0.5" else args.full for size in sizes}
    root = tempfile.mkdtemp(prefix="safeload-remote-")
    hub_dir = os.path.join(root, HUB_REPO, "resolve", "main")
    os.makedirs(os.path.join(root, "bench"))
    os.makedirs(hub_dir)
    for size in sizes:
        for folder in (os.path.join(root, "bench"), hub_dir):
            os.symlink(os.path.abspath(files[size]), os.path.join(folder, f"{size}.safetensors"))
    s3 = S3Server(root, extra=["--copy-links"], dir_cache="1h")
    s3_info = {"endpoint": s3.url, "key": KEY, "secret": SECRET, "options": s3.options()}
    http: Dict[str, Any] = {}
    for latency in args.latency.split(","):
        proc = subprocess.Popen([sys.executable, range_server_py, root, "--latency", latency],
                                stdout=subprocess.PIPE, text=True)
        http[latency] = (proc, proc.stdout.readline().strip())  # type: ignore[union-attr]
    hubs: Dict[str, Any] = {}  # latency -> (process, URL) of the loopback Hub
    mount = None
    try:
        import importlib.util

        names = ["sl_s3", "sl_s3_again", "sl_s3_verify", "boto3", "st_fuse", "sl_fuse", "curl_s3", "sl_http",
                 "sl_http_again", "sl_http_verify", "sl_hub", "sl_hub_verify", "urllib", "curl_http"]
        if importlib.util.find_spec("runai_model_streamer"):
            names.insert(3, "runai")
        names = [n for n in names if any(fnmatch.fnmatch(n, pat) for pat in args.contenders.split(","))]
        if any(n.endswith("_fuse") for n in names):
            try:
                mount = RcloneMount(s3_info)
            except RuntimeError as e:
                print(f"FUSE contenders skipped: {e}", file=sys.stderr)
                names = [n for n in names if not n.endswith("_fuse")]
        tunings: List[Dict[str, Any]] = [{}]
        if args.sweep:
            names = [n for n in names if n.startswith("sl_")]
            tunings = [{"threads": t, "chunk_bytes": c << 20} for t in (16, 32, 64) for c in (8, 16, 32)]
        if any(n.startswith("sl_hub") for n in names):
            for latency in args.latency.split(","):
                # Its storage: another host name, as the Hub's redirects leave it for a CDN.
                spec = {"root": root, "latency": float(latency),
                        "storage": http[latency][1].replace("127.0.0.1", "localhost")}
                proc = subprocess.Popen([sys.executable, __file__, "--hub", json.dumps(spec)],
                                        stdout=subprocess.PIPE, text=True)
                hubs[latency] = (proc, proc.stdout.readline().strip())  # type: ignore[union-attr]
        rows: Dict[tuple, List[Dict[str, Any]]] = {}
        for size in sizes:
            nbytes = os.path.getsize(files[size])
            data_bytes = _data_bytes(files[size])
            # Untimed: the server's first requests (its own start-up) and the file's first read
            # into the page cache would be charged to whichever contender came first.
            warm = {"contender": "curl", "url": f"s3://bench/{size}.safetensors", "s3": s3_info, "size": nbytes}
            subprocess.run([sys.executable, __file__, "--worker", json.dumps(warm)], capture_output=True, check=True)
            sha256 = _sha256(files[size]) if any(n.endswith("_verify") for n in names) else None
            for _, hub_url in hubs.values():
                _warm_hub(f"{hub_url}/{HUB_REPO}/resolve/main/{size}.safetensors")
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]  # no contender always first
                for latency in args.latency.split(","):
                    for name, tuning in [(n, t) for n in order for t in tunings]:
                        s3_side = name in S3_SIDE
                        if s3_side and latency != args.latency.split(",")[0]:
                            continue  # rclone adds no latency: S3 contenders run once per round
                        base = "s3://bench" if s3_side else f"{http[latency][1]}/bench"
                        spec = {"contender": name.replace("_s3", "").replace("_http", "") if name.startswith("curl") else name,
                                "url": f"{base}/{size}.safetensors", "s3": s3_info, "size": nbytes, **tuning}
                        spec.update(_hub_and_verify(name, size, sha256, hubs[latency][1] if hubs else None))
                        if mount is not None:
                            spec["fuse_path"] = os.path.join(mount.path, f"{size}.safetensors")
                        label = name + (f" {tuning['threads']}x{tuning['chunk_bytes'] >> 20}MiB" if tuning else "")
                        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                             capture_output=True, text=True, timeout=1800)
                        if out.returncode != 0:
                            print(f"{label} {size} failed: {out.stderr[-500:]}", file=sys.stderr)
                            continue
                        result = json.loads(out.stdout.strip().splitlines()[-1])
                        if result["bytes"] != (nbytes if name.startswith("curl") else data_bytes):
                            raise SystemExit(f"{label} {size}: loaded {result['bytes']} bytes, not the file's data")
                        key = (size, "-" if s3_side else latency, label)
                        rows.setdefault(key, []).append(result)
                        rate = result["bytes"] / result["seconds"] / GIB
                        print(f"  round {r + 1} {size} GiB lat {key[1]} {label}: {rate:.2f} GiB/s, "
                              f"peak RSS {result['rss_mib']:.0f} MiB", file=sys.stderr, flush=True)
        print("| file | added latency | contender | GiB/s (median) | peak RSS MiB | RSS growth MiB |")
        print("|---|---|---|---|---|---|")
        for (size, latency, name), results in rows.items():
            rate = statistics.median(x["bytes"] / x["seconds"] / GIB for x in results)
            rss = statistics.median(x["rss_mib"] for x in results)
            growth = statistics.median(x["rss_growth_mib"] for x in results)
            lat = latency if latency == "-" else f"{float(latency) * 1000:.0f} ms"
            print(f"| {os.path.getsize(files[size]) / GIB:.2f} GiB | {lat} | {name} | {rate:.2f} | {rss:.0f} | {growth:.0f} |")
        if any(name.endswith("_verify") for _, _, name in rows):
            _verify_ratios(rows, {size: os.path.getsize(files[size]) / GIB for size in sizes})
    finally:
        if mount is not None:
            mount.stop()
        s3.stop()
        for proc, _ in [*hubs.values(), *http.values()]:
            proc.terminate()
            proc.wait()
        shutil.rmtree(root)  # the served tree: symlinks to the files, which stay


if __name__ == "__main__":
    main()
