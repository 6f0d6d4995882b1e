"""Multi-process checkpoint loading on ``torch.distributed``.

``safeload.torch.load_checkpoint(path, process_group=pg)`` splits the read between the ranks of
``pg``: the tensors, in (shard, offset) order, are cut into one contiguous run per rank with
about the same number of bytes, each rank reads its run with safeload's engine, and the group's
collectives (``broadcast``, or ``send``/``recv`` when only some ranks want a tensor) give every
rank the tensors it needs. Works with gloo (exchanges CPU tensors) and NCCL (exchanges CUDA
tensors on the current CUDA device).

* ``ranks_needing={name: [group ranks]}``: who needs each tensor (names absent: every rank);
  ``selection=[names]``: the names this rank wants (gathered from every rank). A tensor no rank
  needs is not read; one needed by a single rank is read by that rank.
* ``plan={name: index}``: per-rank slices (``index`` as ``get_slice`` takes it, e.g.
  ``(slice(None), slice(c0, c1))``), each rank reads only the byte ranges its slices need; no
  tensor is exchanged (with a ``process_group``, the ranks only agree on failures).

A rank whose planning or read fails makes every rank raise :class:`SafetensorError` naming the
failing rank, rather than leaving the others waiting in a collective.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from . import _device, _logging
from ._frameworks import to_dtype, to_torch, torch_dtype, torch_shape
from . import _safeload
from ._options import Options, open_options
from ._safeload import Checkpoint, SafetensorError

__all__ = ["load_checkpoint", "assign_owners"]

#: Tensors smaller than this are exchanged in batches (one message per batch, not per tensor).
SMALL_BYTES = 1 << 20
#: Largest batch of small tensors in one message.
BUCKET_BYTES = 32 << 20
#: Each rank reads its share in batches of about this many bytes; batch k of every rank is sent
#: while batch k + 1 is read.
BATCH_BYTES = 64 << 20


class _Entry:
    """A tensor of the load as the exchange needs it: the reader's plan of it (a ``Share``: its
    header entry, owner, needing) and its torch dtype and shape."""

    __slots__ = ("name", "nbytes", "owner", "needing", "dtype", "tshape")

    def __init__(self, share: Any) -> None:
        info = share.info
        self.name, self.nbytes, self.owner, self.needing = info.name, info.nbytes, share.owner, share.needing
        self.dtype = torch_dtype(info.dtype, info.name)
        self.tshape = torch_shape(info.dtype, info.shape)


def assign_owners(sizes: Sequence[int], world: int, preset: Optional[Sequence[int]] = None) -> List[int]:
    """The rank reading each item (in offset order): contiguous runs, balanced by bytes.

    ``preset`` (optional) gives a fixed owner (>= 0) for some items, e.g. a tensor only one
    rank needs; the others are split so that every rank's total is as close to an equal share
    as contiguous runs allow (an item goes to the rank whose byte range holds its midpoint)."""
    return _safeload.assign_owners(list(sizes), world, None if preset is None else list(preset))


# -- collectives helpers -------------------------------------------------------------------------


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available():
        raise SafetensorError("torch.distributed is not available in this torch build")
    return dist


def _group(process_group: Any) -> Any:
    dist = _dist()
    if not dist.is_initialized():
        raise SafetensorError("load_checkpoint(process_group=...) needs torch.distributed.init_process_group first")
    return dist.group.WORLD if process_group is None else process_group


def _comm_device(dist: Any, group: Any) -> Any:
    import torch

    if str(dist.get_backend(group)).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(dist: Any, group: Any, rank: int, error: Optional[BaseException], payload: Any = None,
           what: str = "load_checkpoint") -> List[Any]:
    """Gathers ``(error message, payload)`` from every rank; raises on every rank if any failed."""
    mine = (None if error is None else f"{type(error).__name__}: {error}", payload)
    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    failed = [(r, msg) for r, (msg, _) in enumerate(gathered) if msg is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise SafetensorError(f"{what} failed on {'rank' if len(failed) == 1 else 'ranks'} "
                              f"{', '.join(str(r) for r, _ in failed)} of the process group ({detail})") from error
    return [p for _, p in gathered]


def _check(dist: Any, group: Any, rank: int, error: Optional[BaseException], comm: Any, what: str,
           before: Any = None) -> None:
    """A cheap agreement (one all_reduce of a flag); on failure, every rank raises via _agree.
    ``before`` runs first on failure (completing async work every rank has posted)."""
    import torch

    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=comm)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()):
        if before is not None:
            before()
        _agree(dist, group, rank, error, None, what)


# -- reading -------------------------------------------------------------------------------------


def _read_share(ckpt: Any, mine: Sequence[_Entry]) -> Dict[str, Any]:
    """Reads this rank's tensors of a round through the checkpoint's one worker pool (shards
    opened once for the whole load), as ``load_checkpoint`` reads them (views of the map where the
    backend maps)."""
    if not mine:
        return {}
    items, _ = ckpt.read([e.name for e in mine])
    return {name: to_torch(code, shape, data, name) for name, code, shape, data in items}


def _flat(t: Any) -> Any:
    import torch

    return t.reshape(-1).view(torch.uint8)


class _Exchange:
    """Sends tensors from their owners to the ranks needing them, round by round, with async
    collectives (so that a round's transfers overlap the next round's reads). Every rank posts
    the same transfers in the same order; each received tensor owns its own storage."""

    def __init__(self, dist: Any, group: Any, rank: int, comm: Any) -> None:
        self.dist, self.group, self.rank, self.comm = dist, group, rank, comm
        world = dist.get_world_size(group)
        self.everyone = set(range(world))
        self.glob = [dist.get_global_rank(group, r) for r in range(world)]
        self.out: Dict[str, Any] = {}
        self.works: List[Any] = []
        self.carve: List[Tuple[Any, List[_Entry]]] = []

    def _mine(self, e: _Entry, have: Dict[str, Any]) -> Any:
        t = self.out.get(e.name)
        if t is None:
            t = have[e.name]
            if t.device != self.comm:
                t = t.to(self.comm)
            if self.rank in e.needing:
                self.out[e.name] = t
        return t

    def post(self, entries: Sequence[_Entry], have: Dict[str, Any]) -> None:
        import torch

        dist, rank, comm = self.dist, self.rank, self.comm
        transfers: List[Tuple[int, Tuple[int, ...], List[_Entry], bool]] = []
        for e in entries:
            if e.nbytes == 0:
                continue
            if e.owner == rank:
                self._mine(e, have)
            receivers = tuple(r for r in e.needing if r != e.owner)
            if not receivers:
                continue
            small = e.nbytes < SMALL_BYTES
            last = transfers[-1] if transfers else None
            if (small and last is not None and last[3] and last[0] == e.owner and last[1] == receivers
                    and sum(x.nbytes for x in last[2]) + e.nbytes <= BUCKET_BYTES):
                last[2].append(e)
            else:
                transfers.append((e.owner, receivers, [e], small))
        for owner, receivers, items, small in transfers:
            if owner != rank and rank not in receivers:
                continue
            if owner == rank:
                if small:
                    buf = torch.cat([_flat(self._mine(e, have)) for e in items])
                else:
                    buf = _flat(self._mine(items[0], have))
            elif small:
                buf = torch.empty(sum(e.nbytes for e in items), dtype=torch.uint8, device=comm)
                self.carve.append((buf, items))
            else:
                e = items[0]
                t = torch.empty(e.tshape, dtype=e.dtype, device=comm)
                self.out[e.name] = t
                buf = _flat(t)
            if set(receivers) | {owner} == self.everyone:
                self.works.append(dist.broadcast(buf, src=self.glob[owner], group=self.group, async_op=True))
            elif owner == rank:
                self.works.extend(dist.isend(buf, dst=self.glob[r], group=self.group) for r in receivers)
            else:
                self.works.append(dist.irecv(buf, src=self.glob[owner], group=self.group))

    def wait(self) -> None:
        works, self.works = self.works, []
        for w in works:
            w.wait()

    def finish(self, entries: Sequence[_Entry]) -> Dict[str, Any]:
        import torch

        self.wait()
        for buf, items in self.carve:
            at = 0
            for e in items:
                self.out[e.name] = buf[at:at + e.nbytes].clone().view(e.dtype).view(e.tshape)
                at += e.nbytes
        self.carve = []
        for e in entries:
            if self.rank in e.needing and e.nbytes == 0:
                self.out[e.name] = torch.empty(e.tshape, dtype=e.dtype, device=self.comm)
        return self.out


def load_checkpoint(
    path_or_paths: Any,
    device: Any = "cpu",
    *,
    process_group: Any = None,
    plan: Optional[Dict[str, Any]] = None,
    ranks_needing: Optional[Dict[str, Iterable[int]]] = None,
    selection: Optional[Iterable[str]] = None,
    backend: Optional[str] = None,
    threads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    drop_cache: bool = False,
    return_stats: bool = False,
    dtype: Any = None,
    storage_options: Optional[Dict[str, Any]] = None,
    verify: Any = None,
    verify_cache: Any = None,
) -> Any:
    """A state dict (torch) of a checkpoint read by the ranks of ``process_group`` together.
    backend, threads, chunk_bytes, drop_cache, storage_options, verify, verify_cache: the
    reader's options (see :class:`safeload._options.Options`); under ``verify``, each
    rank reads and hashes whole every shard it reads a part of, and checks it before its part is
    shared. ``dtype`` converts the floating-point tensors (as torch's ``.to``).

    Ranks in ``ranks_needing`` are ranks within ``process_group``. ``return_stats``: also
    return a :class:`~safeload._open.Stats` whose ``bytes_read`` counts the bytes this
    process read from storage. See the module docstring."""
    target = _device.parse(device)
    # Checked where the checkpoint opens, whose errors (these too) every rank learns of.
    options = Options(backend=backend, threads=threads, chunk_bytes=chunk_bytes, drop_cache=drop_cache,
                      storage_options=storage_options, verify=verify, verify_cache=verify_cache)
    if plan is not None:
        if ranks_needing is not None or selection is not None:
            raise SafetensorError("plan= reads per-rank slices; it does not combine with ranks_needing/selection")
        return _load_plan(path_or_paths, target, process_group, plan, return_stats, dtype, options)
    dist = _dist()
    group = _group(process_group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    comm = _comm_device(dist, group)
    started = time.perf_counter()

    def open_checkpoint() -> Any:
        return Checkpoint(path_or_paths, open_options(**options))

    ckpt, dev, paths, selections = _open_agreed(dist, group, rank, target, open_checkpoint, selection)
    entries, rounds = _plan_rounds(dist, group, rank, comm, ckpt, world, ranks_needing, selections)
    out = _read_and_exchange(dist, group, rank, comm, ckpt, entries, rounds)
    stats = ckpt.stats()  # what this rank read
    ckpt.close()
    if dev != comm:
        out = {k: v.to(dev) for k, v in out.items()}
    state = to_dtype({e.name: out[e.name] for e in entries if e.name in out}, dtype)
    _logging.log_read(paths, stats, f"load_checkpoint(rank {rank}/{world}, {time.perf_counter() - started:.3f}s)")
    return (state, stats) if return_stats else state


def _open_agreed(dist: Any, group: Any, rank: int, target: Any, open_checkpoint: Callable[[], Any],
                 selection: Optional[Iterable[str]]) -> Tuple[Any, Any, List[str], Optional[List[Any]]]:
    """Opens the checkpoint on every rank and makes sure they all see the same one: the
    checkpoint, the torch device, its paths, and every rank's selection (None: no rank gave one)."""
    error: Optional[BaseException] = None
    paths: List[str] = []
    digest = ""
    dev: Any = None
    ckpt: Any = None
    try:
        dev = _device.torch_device(target)
        ckpt = open_checkpoint()
        paths = ckpt.paths
        digest = ckpt.digest()
    except Exception as exc:  # every rank must learn of it: see _agree
        error = exc
    payload = (digest, None if selection is None else sorted(set(selection)))
    gathered = _agree(dist, group, rank, error, payload, "load_checkpoint (planning)")
    if len({d for d, _ in gathered}) != 1:
        raise SafetensorError("load_checkpoint: the ranks of the process group see different checkpoints "
                              "(shard names, tensor names, dtypes, shapes or offsets differ)")
    selections = None if all(s is None for _, s in gathered) else [s for _, s in gathered]
    return ckpt, dev, paths, selections


def _plan_rounds(dist: Any, group: Any, rank: int, comm: Any, ckpt: Any, world: int,
                 ranks_needing: Optional[Dict[str, Iterable[int]]],
                 selections: Optional[List[Any]]) -> Tuple[List[_Entry], List[List[_Entry]]]:
    """Every tensor of the load (who reads it, who needs it) and the rounds they are read in,
    planned alike on every rank."""
    error: Optional[BaseException] = None
    entries: List[_Entry] = []
    rounds: List[List[_Entry]] = []
    try:
        needing = None if ranks_needing is None else {n: [int(r) for r in rs] for n, rs in ranks_needing.items()}
        shares, planned = ckpt.shares(world, ranks_needing=needing, selections=selections, batch_bytes=BATCH_BYTES)
        entries = [_Entry(s) for s in shares]
        rounds = [[entries[i] for i in r] for r in planned]
    except Exception as exc:
        error = exc
    _check(dist, group, rank, error, comm, "load_checkpoint (planning)")
    return entries, rounds


def _read_and_exchange(dist: Any, group: Any, rank: int, comm: Any, ckpt: Any, entries: List[_Entry],
                       rounds: List[List[_Entry]]) -> Dict[str, Any]:
    """Reads this rank's share round by round, each round's transfers overlapping the next
    round's read; the tensors this rank needs, on ``comm``."""
    exchange = _Exchange(dist, group, rank, comm)
    for batch in rounds:
        have: Dict[str, Any] = {}
        error: Optional[BaseException] = None
        try:
            have = _read_share(ckpt, [e for e in batch if e.owner == rank])
        except Exception as exc:
            error = exc
        _check(dist, group, rank, error, comm, "load_checkpoint (read)", exchange.wait)
        exchange.post(batch, have)
        del have
    return exchange.finish(entries)


def _load_plan(path_or_paths: Any, target: str, process_group: Any, plan: Dict[str, Any], return_stats: bool,
               dtype: Any, options: Options) -> Any:
    """This rank's slices: ``{name: tensor[index]}``, reading only the byte ranges they need
    (under ``verify``, every shard a slice is cut from is read and hashed whole first)."""
    out: Dict[str, Any] = {}
    paths: List[str] = []
    stats: Any = None
    error: Optional[BaseException] = None
    try:
        ckpt = Checkpoint(path_or_paths, open_options(**options))
        try:
            paths = ckpt.paths
            missing = set(plan) - {i.name for i in ckpt.infos()}
            if missing:
                raise SafetensorError(f"plan names tensors the checkpoint does not have: {sorted(missing)[:5]}")
            for h in ckpt.handles():  # the plan says which bytes are wanted: nothing is read ahead
                for name in h.offset_keys():
                    if name in plan:
                        index = plan[name]
                        rcode, rshape, data = h.read_slice(name, Ellipsis if index is None else index)
                        out[name] = to_torch(rcode, rshape, data, name)
            stats = ckpt.stats()  # every read, whole tensors and slices, records its bytes
        finally:
            ckpt.close()
        if target != "cpu":
            dev = _device.torch_device(target)
            out = {k: v.to(dev) for k, v in out.items()}
        out = to_dtype(out, dtype)
    except Exception as exc:
        if process_group is None:
            raise
        error = exc
    if process_group is not None:
        dist = _dist()
        group = _group(process_group)
        _agree(dist, group, dist.get_rank(group), error, None, "load_checkpoint (plan)")
    _logging.log_read(paths, stats, "load_checkpoint(plan)")
    return (out, stats) if return_stats else out
