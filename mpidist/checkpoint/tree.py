"""How a checkpoint holds a state dict without pickle: every tensor a dataset of an HDF5 group,
named by its path in the state, with a ``torch_dtype`` attribute (types NumPy lacks, such as
bfloat16 and float8, kept as unsigned integers of the same width and viewed back, so every value
round-trips bit for bit), and the rest of the state a JSON tree in the group's ``tree``
attribute, where {TENSOR: name} stands for a tensor, {TUPLE: [...]} for a tuple and
{ITEMS: [[key, value], ...]} for a dictionary whose keys are not all strings.

Reading checks what a file from elsewhere could claim: values that are not numbers, shapes that
claim more bytes than the file stores, and torch dtypes that do not fit the stored values are
CheckpointErrors naming the file and the dataset.
"""
from __future__ import annotations

import json

import numpy as np

from ..errors import CheckpointError

TENSOR, TUPLE, ITEMS = "__tensor__", "__tuple__", "__items__"


def write_tensor(group, name: str, tensor):
    t = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    try:
        array = t.numpy()
    except TypeError:  # no NumPy type (bfloat16, float8): keep the bits in an unsigned integer
        array = t.view(_UNSIGNED[t.element_size()]).numpy()
    dataset = group.create_dataset(name, data=array)
    dataset.attrs["torch_dtype"] = str(t.dtype).removeprefix("torch.")


def read_tensor(dataset):
    import torch
    where = f"{dataset.file.filename}: {dataset.name}"
    if dataset.dtype.kind not in "biufc":
        raise CheckpointError(f"{where} holds {dataset.dtype} values, not numbers")
    claimed, stored = dataset.size * dataset.dtype.itemsize, dataset.id.get_storage_size()
    if claimed != stored:  # save_checkpoint writes every element; shape attributes can claim anything
        raise CheckpointError(f"{where}: its shape {list(dataset.shape)} claims {claimed} bytes, the file "
                              f"stores {stored}")
    value = dataset[()]
    array = value if isinstance(value, np.ndarray) else np.array(value)
    name = dataset.attrs.get("torch_dtype")
    # by torch's own name, not the wire's table: a checkpoint keeps every torch dtype (complex,
    # float8), not only those ranks exchange
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where}: unknown torch_dtype {name!r}")
    if dtype.itemsize != array.dtype.itemsize:
        raise CheckpointError(f"{where}: torch_dtype {name} does not fit its {array.dtype} values")
    tensor = torch.from_numpy(array)
    return tensor if tensor.dtype == dtype else tensor.view(dtype)


class _Unsigned(dict):
    def __missing__(self, width):
        import torch
        table = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
        if width not in table:
            raise CheckpointError(f"cannot store tensors of {width}-byte elements")
        return table[width]


_UNSIGNED = _Unsigned()


def _dataset_name(part) -> str:
    # HDF5 reads '/' as a path separator and '.' as the group itself.
    name = str(part).replace("%", "%25").replace("/", "%2F")
    return "%2E" if name == "." else name


def encode(value, group, path):
    """``value`` as a JSON-able tree; tensors become datasets of ``group`` named by their path."""
    import torch
    if isinstance(value, torch.Tensor):
        name = "/".join(_dataset_name(part) for part in path)
        write_tensor(group, name, value)
        return {TENSOR: name}
    if isinstance(value, dict):
        plain = all(isinstance(key, str) for key in value) and not {TENSOR, TUPLE, ITEMS} & set(value)
        if plain:
            return {key: encode(item, group, path + [key]) for key, item in value.items()}
        return {ITEMS: [[_json_key(key, path), encode(item, group, path + [key])] for key, item in value.items()]}
    if isinstance(value, tuple):
        return {TUPLE: [encode(item, group, path + [i]) for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [encode(item, group, path + [i]) for i, item in enumerate(value)]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(
        f"cannot store {type(value).__name__} at {'/'.join(map(str, path))}: checkpoints hold tensors and "
        "JSON values only (no pickle)")


def _json_key(key, path):
    if key is None or isinstance(key, (bool, int, float, str)):
        return key
    raise CheckpointError(f"cannot store a {type(key).__name__} dictionary key at {'/'.join(map(str, path))}")


def decode(tree, group):
    if isinstance(tree, list):
        return [decode(item, group) for item in tree]
    if isinstance(tree, dict):
        if TENSOR in tree:
            return read_tensor(group[tree[TENSOR]])
        if TUPLE in tree:
            return tuple(decode(item, group) for item in tree[TUPLE])
        if ITEMS in tree:
            return {key: decode(item, group) for key, item in tree[ITEMS]}
        return {key: decode(item, group) for key, item in tree.items()}
    return tree


def write_tree(group, value):
    group.attrs["tree"] = json.dumps(encode(value, group, []))


def read_tree(group):
    return decode(json.loads(group.attrs["tree"]), group)
