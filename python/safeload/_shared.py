"""Names that share memory (tied weights, views of one buffer): which tensors overlap, which name
of each group is kept, and how the dropped ones count on load. One module for this bookkeeping,
used by saving (``safeload.torch``) and by loading into a model (``_inplace``); names and behaviour
of ``safetensors.torch``'s helpers."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch


def storage_ptr(tensor: torch.Tensor) -> int:
    """Address of the storage under ``tensor`` (0 for meta tensors)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:
        try:
            return tensor.storage().data_ptr()
        except NotImplementedError:
            return 0


def storage_size(tensor: torch.Tensor) -> int:
    """Bytes of the storage under ``tensor``."""
    try:
        return tensor.untyped_storage().nbytes()
    except AttributeError:
        try:
            return tensor.storage().size() * tensor.element_size()
        except NotImplementedError:
            return tensor.nelement() * tensor.element_size()


def _end_ptr(tensor: torch.Tensor) -> int:
    if tensor.nelement():
        return tensor.view(-1)[-1].data_ptr() + tensor.element_size()
    return tensor.data_ptr()


def _filter_shared_not_shared(tensors: List[Set[str]], state_dict: Dict[str, torch.Tensor]) -> List[Set[str]]:
    """Splits groups sharing a storage into groups whose byte ranges actually overlap."""
    result: List[Set[str]] = []
    for group in tensors:
        if len(group) < 2:
            result.append(group)
            continue
        areas = sorted((state_dict[n].data_ptr(), _end_ptr(state_dict[n]), n) for n in group)
        _, last_stop, first = areas[0]
        result.append({first})
        for start, stop, name in areas[1:]:
            if start >= last_stop:
                result.append({name})
            else:
                result[-1].add(name)
            last_stop = stop
    return result


def _storage_of(tensor: torch.Tensor) -> Tuple[int, int]:
    """``(storage_ptr(tensor), storage_size(tensor))`` with one storage lookup."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except Exception:
        return storage_ptr(tensor), storage_size(tensor)


def _shared_groups(state_dict: Dict[str, torch.Tensor]) -> Tuple[List[Set[str]], Dict[str, Tuple[int, int]]]:
    """``_find_shared_tensors`` and the storage of each name in its groups, looked up once per
    tensor (a model of 20,000 parameters spent 80 ms asking each tensor for it four times)."""
    groups: Dict[Tuple[Any, int, int], Set[str]] = defaultdict(set)
    storages: Dict[str, Tuple[int, int]] = {}
    for name, tensor in state_dict.items():
        if tensor.is_meta:
            continue
        ptr, size = storages[name] = _storage_of(tensor)
        if ptr != 0 and size != 0:
            groups[(tensor.device, ptr, size)].add(name)
    return _filter_shared_not_shared(list(sorted(groups.values())), state_dict), storages


def _find_shared_tensors(state_dict: Dict[str, torch.Tensor]) -> List[Set[str]]:
    """Groups of names whose tensors overlap in memory."""
    return _shared_groups(state_dict)[0]


def _is_complete(tensor: torch.Tensor, storage: Optional[Tuple[int, int]] = None) -> bool:
    """Whether ``tensor`` covers its whole storage (``storage``: its ``_storage_of``, if known)."""
    ptr, size = storage or _storage_of(tensor)
    return tensor.data_ptr() == ptr and tensor.nbytes == size


def _remove_duplicate_names(
    state_dict: Dict[str, torch.Tensor],
    *,
    preferred_names: Optional[Iterable[str]] = None,
    discard_names: Optional[Iterable[str]] = None,
) -> Dict[str, List[str]]:
    """For each group of shared tensors, the name to keep -> the names to drop."""
    preferred = set(preferred_names or [])
    discard = set(discard_names or [])
    to_remove: Dict[str, List[str]] = defaultdict(list)
    groups, storages = _shared_groups(state_dict)
    for shared in groups:
        complete = {n for n in shared if _is_complete(state_dict[n], storages[n])}
        if not complete:
            raise RuntimeError(
                "Error while trying to find names to remove to save state dict, but found no suitable name to keep"
                f" for saving amongst: {shared}. None is covering the entire storage.Refusing to save/load the model"
                " since you could be storing much more memory than needed. Please refer to"
                " https://huggingface.co/docs/safetensors/torch_shared_tensors for more information. Or open an"
                " issue."
            )
        if len(shared) == 1:
            continue  # alone in its memory: kept, nothing to drop
        keep = sorted(complete)[0]
        kept_not_discarded = complete - discard
        if kept_not_discarded:
            keep = sorted(kept_not_discarded)[0]
        if preferred and preferred & complete:
            keep = sorted(preferred & complete)[0]
        for name in sorted(shared):
            if name != keep:
                to_remove[keep].append(name)
    return to_remove


def account_removed(to_removes: Dict[str, List[str]], missing: set,
                    unexpected: List[str]) -> Tuple[set, List[str]]:
    """safetensors' bookkeeping of names dropped as duplicates of shared memory: expected
    missing ones are not missing, present ones are unexpected."""
    for group in to_removes.values():
        for name in group:
            if name not in missing:
                unexpected.append(name)
            else:
                missing.remove(name)
    return missing, unexpected
