"""Route safetensors' loaders through safeload, without editing the code that calls them.

    import safeload
    safeload.patch()            # safetensors.safe_open, safetensors.torch.load_file, ... -> safeload
    ...
    safeload.unpatch()          # everything back, by identity

    with safeload.patched():    # or only for a block
        model = transformers.AutoModel.from_pretrained(path)

What is replaced: ``safetensors.safe_open``, ``safetensors.torch.load_file`` / ``load`` /
``load_model`` / ``save_file``, ``safetensors.numpy.load_file`` / ``save_file`` (so
``save_pretrained`` and ``save_model`` write through safeload's parallel writer; with
``SAFELOAD_SAVE_MANIFEST=1`` each file's SHA-256 also goes into the ``SHA256SUMS`` beside it) and
transformers' hf-mount check
(``transformers.modeling_utils._is_on_hf_mount``, which would make transformers read a whole shard
with one ``read()``), transformers' expert fusion (``transformers.core_model_loading``'s
``spawn_materialize`` and ``WeightConverter``'s ``add_tensor`` / ``convert``: each fused expert
tensor made once and every expert read into its slot, see ``_moe.py``), *and every other module attribute that is one of those objects*: names that other modules already imported (``from safetensors import
safe_open`` in ``transformers.modeling_utils``, say) are found by scanning ``sys.modules`` for
identity and replaced too; each ``(module, name, original)`` is remembered so that
:func:`unpatch` puts back exactly the object that was there. ``safetensors.torch`` and
``safetensors.numpy`` that are imported later are patched as they finish importing.

Backends: safetensors 0.8's loaders default to ``backend="mmap"``, safeload's to ``"auto"``.
Patched, a call that passes no backend gets safeload's ``"auto"`` (or ``$SAFELOAD_BACKEND``); a
call that passes one, ``backend="mmap"`` included, keeps it (safeload's own mmap reader).
``patch(backend="pread")`` forces one backend for every load while patched, explicit ones
included (transformers, for one, passes ``backend="mmap"`` explicitly): the reader applies it, as
it applies ``$SAFELOAD_BACKEND`` (one rule, in Rust: docs/backends.md).

Without code changes: set ``SAFELOAD_PATCH=1`` (or a backend name, which also forces that
backend) and the ``safeload_autopatch.pth`` startup hook patches at interpreter start. Wheels
install the hook; for an editable or development install run ``safeload patch-install``.

safeload's own modules are never rewritten (``safeload.bench`` keeps comparing against the real
safetensors objects it imported).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import os
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ._safeload import BACKENDS, _force_backend, _forced_backend

__all__ = ["patch", "unpatch", "patched", "is_patched", "originals", "ENV", "PTH_NAME", "PTH_LINE"]

#: Environment variable read by the startup hook.
ENV = "SAFELOAD_PATCH"
#: File name of the startup hook in site-packages.
PTH_NAME = "safeload_autopatch.pth"
#: The hook's one line: costs one ``os.environ`` lookup when the variable is unset.
PTH_LINE = (
    'import os; os.environ.get("SAFELOAD_PATCH", "").strip().lower() not in ("", "0", "false", "no", "off") '
    'and __import__("safeload.patch", fromlist=["_autopatch"])._autopatch()'
)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

# module name -> attribute names replaced there
_TARGETS: Dict[str, Tuple[str, ...]] = {
    "safetensors": ("safe_open",),
    "safetensors.torch": ("load_file", "load", "load_model", "save_file"),
    "safetensors.numpy": ("load_file", "save_file"),
    # transformers reads a whole shard with one read() on hf-mount (to avoid mapping it); patched,
    # safe_open reads network mounts with safeload's reader and never maps them.
    "transformers.modeling_utils": ("_is_on_hf_mount",),
    # mixture-of-experts: experts bound for a fused tensor are read straight into it (_moe.py)
    "transformers.core_model_loading": ("spawn_materialize", "convert_and_load_state_dict_in_model"),
}

_lock = threading.RLock()
_active = False
#: "module.name" -> the original safetensors object (kept after unpatch, for re-patching)
_originals: Dict[str, Any] = {}
#: "module.name" -> safeload's stand-in (created once, so identity is stable across re-patching)
_replacements: Dict[str, Any] = {}
#: (module, attribute, original) for every attribute rewritten, for unpatch
_records: List[Tuple[Any, str, Any]] = []
_finder: Optional["_Finder"] = None


# -- stand-ins --------------------------------------------------------------------------------


def _make(key: str, original: Any) -> Any:
    """safeload's stand-in for the safetensors object ``key`` (a fresh object, never one of
    safeload's public ones, so that unpatch can tell what patch put in place)."""
    if key == "safetensors.safe_open":
        from ._open import DEFAULT_BACKEND
        from ._open import safe_open as base

        class safe_open(base):  # noqa: N801 - same name as what it replaces
            __doc__ = base.__doc__

            def __init__(self, filename: Any, framework: str, device: Any = "cpu", *,
                         backend: Optional[str] = DEFAULT_BACKEND, **kwargs: Any) -> None:
                super().__init__(filename, framework, device, backend=backend, **kwargs)

        safe_open.__module__ = __name__  # repr: <class 'safeload.patch.safe_open'>
        safe_open.__qualname__ = "safe_open"
        return safe_open

    if key == "transformers.modeling_utils._is_on_hf_mount":

        def _is_on_hf_mount(path: Any) -> bool:
            """Patched by safeload: never True, so transformers opens hf-mount shards with
            ``safe_open`` (safeload's, which reads network mounts with its parallel reader and never
            maps them) instead of one ``read()`` of the whole file."""
            return False

        functools.update_wrapper(_is_on_hf_mount, original, assigned=("__module__", "__name__", "__qualname__"),
                                 updated=())
        return _is_on_hf_mount

    if key == "transformers.core_model_loading.spawn_materialize":
        from . import _moe

        return _moe.spawn_for(original)

    if key == "transformers.core_model_loading.convert_and_load_state_dict_in_model":
        from . import _moe

        return _moe.load_for(original)

    if key.startswith("safetensors.torch."):
        from . import torch as impl
    else:
        from . import numpy as impl  # type: ignore[no-redef]
    from ._open import DEFAULT_BACKEND

    target = getattr(impl, key.rsplit(".", 1)[1])
    if key == "safetensors.torch.load_file":

        def load_file(filename: Any, device: Any = "cpu", *, backend: Optional[str] = DEFAULT_BACKEND) -> Any:
            return target(filename, device=device, backend=backend)

        fn: Callable[..., Any] = load_file
    elif key == "safetensors.torch.load_model":

        def load_model(model: Any, filename: Any, strict: bool = True, device: Any = "cpu", *,
                       backend: Optional[str] = DEFAULT_BACKEND) -> Any:
            return target(model, filename, strict=strict, device=device, backend=backend)

        fn = load_model
    elif key == "safetensors.torch.load":

        def load(data: bytes) -> Any:
            return target(data)

        fn = load
    elif key.endswith(".save_file"):
        from ._save import manifest_wanted

        def save_file(tensors: Any, filename: Any, metadata: Optional[Dict[str, str]] = None) -> None:
            return target(tensors, filename, metadata=metadata, manifest=manifest_wanted())

        fn = save_file
    elif key == "safetensors.numpy.load_file":

        def load_file(filename: Any, *, backend: Optional[str] = DEFAULT_BACKEND) -> Any:  # type: ignore[misc]
            return target(filename, backend=backend)

        fn = load_file
    else:  # pragma: no cover - _TARGETS and this function go together
        raise KeyError(key)
    functools.update_wrapper(fn, target, assigned=("__module__", "__name__", "__qualname__", "__doc__"),
                             updated=())
    return fn


# -- rewriting modules ------------------------------------------------------------------------


def _own(name: str) -> bool:
    return name == "safeload" or name.startswith("safeload.")


def _module_dicts(scope: Optional[List[Any]] = None) -> Iterator[Tuple[Any, Dict[str, Any]]]:
    """Each module's namespace: of ``scope``'s modules, or of every module loaded."""
    named = [(getattr(m, "__name__", ""), m) for m in scope] if scope is not None else list(sys.modules.items())
    for name, module in named:
        if module is None or not isinstance(name, str) or _own(name):
            continue
        try:
            d = object.__getattribute__(module, "__dict__")
        except Exception:  # noqa: BLE001 - odd objects in sys.modules
            continue
        if isinstance(d, dict):
            yield module, d


def _swap(pairs: Dict[int, Tuple[Any, Any]], record: bool, scope: Optional[List[Any]] = None) -> None:
    """Replace every module attribute that ``is`` a key object of ``pairs`` (by id) with its
    partner, in ``scope``'s modules (default: every module loaded); when ``record``, remember
    (module, name, old) for unpatch."""
    if not pairs:
        return
    for module, d in _module_dicts(scope):
        hits = [(k, v) for k, v in list(d.items()) if id(v) in pairs and pairs[id(v)][0] is v]
        for name, old in hits:
            d[name] = pairs[id(old)][1]
            if record:
                _records.append((module, name, old))


def _apply(loaded: Optional[Tuple[str, List[Any]]] = None) -> None:
    """Patch whatever of ``_TARGETS`` is imported, and every alias of it.

    ``loaded``: the name of a module that has just run and the modules loaded while it ran (it
    included). Where every object to replace is one that module defines, only those modules can
    hold it, and only they are searched: a search of every module's names costs ~35 ms with
    transformers loaded (110,000 names), inside the ``from_pretrained`` that imports
    ``safetensors.torch``."""
    pairs: Dict[int, Tuple[Any, Any]] = {}
    for modname, names in _TARGETS.items():
        module = sys.modules.get(modname)
        if module is None:
            continue
        for name in names:
            key = f"{modname}.{name}"
            current = getattr(module, name, None)
            if current is None or current is _replacements.get(key):
                continue
            if key not in _originals or current is not _originals[key]:
                # first sight, or safetensors was reloaded: this is the object to stand in for
                _originals[key] = current
                _replacements[key] = _make(key, current)
            pairs[id(current)] = (current, _replacements[key])
    defined_there = loaded is not None and all(
        getattr(old, "__module__", None) == loaded[0] for old, _ in pairs.values())
    _swap(pairs, record=True, scope=loaded[1] if loaded is not None and defined_there else None)
    core_model_loading = sys.modules.get("transformers.core_model_loading")
    if core_model_loading is not None:
        from . import _moe

        _moe.hook(core_model_loading)


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then patches the module it filled."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        before = set(sys.modules)
        self._inner.exec_module(module)
        with _lock:
            if _active:
                fresh = [m for n, m in list(sys.modules.items()) if n not in before]
                _apply((module.__name__, [module, *fresh]))

    def __getattr__(self, name: str) -> Any:  # get_data, get_resource_reader, ...
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches ``safetensors.torch`` / ``safetensors.numpy`` imported after :func:`patch`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _Finder):
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


# -- public API -------------------------------------------------------------------------------


def patch(backend: Optional[str] = None) -> None:
    """Make safetensors' loaders (and every name already imported from them) safeload's.

    Idempotent. ``backend``: force this backend ("auto", "pread", "direct" or "mmap") on every
    load, even ones that pass ``backend=`` themselves; default None keeps what callers pass (no
    backend: safeload's "auto"). Calling again with another ``backend`` changes it; a name that is
    not a backend is a ValueError."""
    global _active, _finder
    with _lock:
        _force_backend(backend)
        try:
            import safetensors  # noqa: F401
        except ImportError:
            pass  # nothing to patch yet; the finder catches a later import
        if _finder is None:
            _finder = _Finder()
            sys.meta_path.insert(0, _finder)
        _active = True
        _apply()


def unpatch() -> None:
    """Put back every original object that :func:`patch` replaced (identity restored), including
    names imported from the patched modules while patched. Idempotent."""
    global _active, _finder
    with _lock:
        if _finder is not None:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(_finder)
            _finder = None
        for module, name, original in reversed(_records):
            d = getattr(module, "__dict__", None)
            key = _key_of(original)
            if isinstance(d, dict) and key is not None and d.get(name) is _replacements.get(key):
                d[name] = original  # leave alone what someone else replaced since
        _records.clear()
        from . import _moe

        _moe.unhook()
        # stragglers: stand-ins picked up by modules imported while patched
        pairs = {id(_replacements[k]): (_replacements[k], _originals[k]) for k in _replacements}
        _swap(pairs, record=False)
        _active = False
        _force_backend(None)


def _key_of(original: Any) -> Optional[str]:
    for key, obj in _originals.items():
        if obj is original:
            return key
    return None


def is_patched() -> bool:
    """Whether :func:`patch` is in effect."""
    return _active


def originals() -> Dict[str, Any]:
    """The safetensors objects patching stands in for, by ``"module.name"`` (those seen so far)."""
    with _lock:
        return dict(_originals)


@contextlib.contextmanager
def patched(backend: Optional[str] = None) -> Iterator[None]:
    """``with safeload.patched(): ...`` patches for the block; on exit restores the state before
    (still patched, with its backend, if it was patched already)."""
    with _lock:
        was_active, was_backend = _active, _forced_backend()
    patch(backend)
    try:
        yield
    finally:
        if was_active:
            patch(was_backend)
        else:
            unpatch()


# -- startup hook -----------------------------------------------------------------------------


def _autopatch() -> None:
    """Called by ``safeload_autopatch.pth`` when ``$SAFELOAD_PATCH`` is set: "1"/"true"/"yes"/"on"
    patch; a backend name patches, and the reader forces that backend (it reads the variable).
    Never raises (it runs inside site)."""
    value = os.environ.get(ENV, "").strip().lower()
    try:
        if value in _FALSE:
            return
        forced = _forced_backend()  # what the reader makes of the variable
        if value in _TRUE or forced is not None:
            patch(backend=forced)
        else:
            sys.stderr.write(f"safeload: ignoring {ENV}={value!r} (use 1, or a backend: {', '.join(BACKENDS)})\n")
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"safeload: {ENV} set but patching failed: {type(exc).__name__}: {exc}\n")


def site_packages() -> str:
    """The site-packages directory of this interpreter (where ``patch-install`` writes)."""
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def install_hook(target: Optional[str] = None) -> str:
    """Write the ``SAFELOAD_PATCH`` startup hook into ``target`` (default: site-packages); returns
    its path."""
    directory = target or site_packages()
    path = os.path.join(directory, PTH_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(PTH_LINE + "\n")
    os.replace(tmp, path)
    return path


def uninstall_hook(target: Optional[str] = None) -> Optional[str]:
    """Remove the startup hook from ``target`` (default: site-packages); returns the path removed,
    or None when there was none."""
    path = os.path.join(target or site_packages(), PTH_NAME)
    try:
        os.remove(path)
    except FileNotFoundError:
        return None
    return path
