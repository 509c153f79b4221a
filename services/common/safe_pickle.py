"""Read a `torch.save` zip (codec.pth) without running any code from the file (MODEL.md §2.5 rule 7).

A torch.save file is a zip holding `<name>/data.pkl` (a pickle of the state dict), one raw record
per storage under `<name>/data/<key>`, and `<name>/byteorder`. An ordinary unpickler imports and
calls whatever globals the pickle names, so a hostile file can run `os.system`. This one:

- resolves globals through an allow-list and hands back our own stand-ins, never the named object:
  `collections.OrderedDict`, `torch._utils._rebuild_tensor_v2`, `torch._utils._rebuild_parameter`,
  the torch storage classes (as `persistent_id` tags), `torch.Size` and the plain builtin
  containers; anything else raises `UnsafePickleError` naming `module.name` and the file;
- refuses the opcodes that instantiate or extend objects in ways a state dict never needs
  (INST, OBJ, NEWOBJ, NEWOBJ_EX, EXT1/2/4), and allows BUILD only to set attributes such as
  `_metadata` on an OrderedDict;
- builds tensors from the raw storage bytes itself, with bounds checks.

It runs on the pure-Python `pickle._Unpickler` because only that one lets us swap the opcode
table; the pickle of a state dict is a few kilobytes, so speed does not matter. Storage bytes are
read into memory (no mmap): codec.pth is well under a gigabyte.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle asked for something outside the allow-list; nothing it named was run."""


@dataclass(frozen=True)
class _StorageTag:
    """Stand-in for a torch storage class in a persistent id: only its element dtype matters."""
    name: str
    dtype: torch.dtype


# Legacy typed storage classes (what torch.save writes for tensors) and the untyped ones.
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "UntypedStorage": torch.uint8,
}


def _rebuild_tensor(storage: torch.Tensor, storage_offset, size, stride, requires_grad=False,
                     backward_hooks=None, metadata=None) -> torch.Tensor:
    """Our `_rebuild_tensor_v2`: a strided view of a flat storage tensor, bounds-checked.

    Hooks and metadata are ignored on purpose (a state dict carries neither in practice, and we
    never attach anything a file asks for).
    """
    if not isinstance(storage, torch.Tensor):
        raise UnsafePickleError(f"tensor storage must come from a persistent id, got {type(storage).__name__}")
    size, stride = tuple(size), tuple(stride)
    ints = (storage_offset, *size, *stride)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
        raise UnsafePickleError(f"bad tensor geometry offset={storage_offset!r} size={size} stride={stride}")
    if len(size) != len(stride):
        raise UnsafePickleError(f"size {size} and stride {stride} differ in rank")
    if all(s > 0 for s in size):
        last = storage_offset + sum((s - 1) * st for s, st in zip(size, stride))
        if last >= storage.numel():
            raise UnsafePickleError(f"tensor view (offset {storage_offset}, size {size}, stride {stride}) "
                                    f"reaches past its storage of {storage.numel()} elements")
    return storage.as_strided(size, stride, storage_offset)


def _rebuild_parameter(data: torch.Tensor, requires_grad=False, backward_hooks=None) -> torch.Tensor:
    """Our `_rebuild_parameter`: a state dict wants the tensor, not an nn.Parameter."""
    if not isinstance(data, torch.Tensor):
        raise UnsafePickleError(f"parameter data must be a tensor, got {type(data).__name__}")
    return data


def _allowed_global(module: str, name: str):
    """The stand-in for an allowed global, or None."""
    if (module, name) == ("collections", "OrderedDict"):
        return collections.OrderedDict
    if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
        return _rebuild_tensor
    if (module, name) == ("torch._utils", "_rebuild_parameter"):
        return _rebuild_parameter
    if (module, name) == ("torch", "Size"):
        return torch.Size
    if module in ("torch", "torch.storage") and name in _STORAGE_DTYPES:
        return _StorageTag(name, _STORAGE_DTYPES[name])
    if module in ("builtins", "__builtin__") and name in ("set", "frozenset", "list", "dict", "tuple"):
        return {"set": set, "frozenset": frozenset, "list": list, "dict": dict, "tuple": tuple}[name]
    return None


def _refuse_opcode(name: str):
    def refuse(self):
        raise UnsafePickleError(f"{self.source}: pickle opcode {name} is not allowed")
    return refuse


class _AllowListUnpickler(pickle._Unpickler):  # noqa: SLF001 - the pure-Python one is the point
    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch.update({getattr(pickle, op)[0]: _refuse_opcode(op)
                     for op in ("INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4")})

    def __init__(self, file, *, source: str, storages: "_StorageReader"):
        super().__init__(file)
        self.source = source
        self.storages = storages

    def find_class(self, module: str, name: str):
        allowed = _allowed_global(module, name)
        if allowed is None:
            raise UnsafePickleError(f"{self.source}: pickle refers to global {module}.{name}, "
                                    "which is not on the allow-list")
        return allowed

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageTag) and isinstance(pid[2], str)):
            raise UnsafePickleError(f"{self.source}: unsupported persistent id {pid!r:.200}")
        _, tag, key, _location, numel = pid
        return self.storages.get(key, tag.dtype, numel)

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if not (isinstance(inst, collections.OrderedDict) and isinstance(state, dict)
                and all(isinstance(k, str) for k in state)):
            raise UnsafePickleError(f"{self.source}: BUILD is allowed only to set attributes of an "
                                    f"OrderedDict, not on {type(inst).__name__}")
        inst.__dict__.update(state)   # no setattr: nothing a file names is ever called

    dispatch[pickle.BUILD[0]] = load_build


class _StorageReader:
    """Raw storage records of the zip, each turned into one flat tensor (shared by its views)."""

    def __init__(self, zf: zipfile.ZipFile, prefix: str, source: str):
        self.zf, self.prefix, self.source = zf, prefix, source
        self.cache: dict[str, torch.Tensor] = {}

    def get(self, key: str, dtype: torch.dtype, numel) -> torch.Tensor:
        if key in self.cache:
            return self.cache[key].view(dtype) if self.cache[key].dtype != dtype else self.cache[key]
        record = f"{self.prefix}data/{key}"
        try:
            raw = bytearray(self.zf.read(record))
        except KeyError:
            raise ValueError(f"{self.source}: storage record {record!r} is missing") from None
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if not isinstance(numel, int) or numel < 0 or len(raw) < numel * itemsize or len(raw) % itemsize:
            raise ValueError(f"{self.source}: storage {key!r} has {len(raw)} bytes, "
                             f"expected {numel} x {itemsize}")
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        self.cache[key] = flat
        return flat


def _archive_prefix(zf: zipfile.ZipFile, source: str) -> str:
    """The zip's top folder ("archive/", or the file stem for older writers), with its slash."""
    pickles = [n for n in zf.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise ValueError(f"{source}: not a torch.save zip (expected one <name>/data.pkl, "
                         f"found {len(pickles)})")
    return pickles[0][: -len("data.pkl")]


def load_torch_state_dict(path: str | Path) -> "collections.OrderedDict[str, torch.Tensor]":
    """Read a torch.save zip of a state dict: {name: tensor} with each tensor's stored dtype.

    Raises UnsafePickleError for anything outside the allow-list (naming the global and the file),
    ValueError for a file that is not a torch.save zip or a malformed one. Nothing in the file runs.
    """
    source = str(path)
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{source}: not a zip file (the legacy non-zip torch.save format is not supported)")
    with zipfile.ZipFile(path) as zf:
        prefix = _archive_prefix(zf, source)
        byteorder = zf.read(f"{prefix}byteorder").decode() if f"{prefix}byteorder" in zf.namelist() else "little"
        if byteorder != "little":
            raise ValueError(f"{source}: byte order {byteorder!r} is not supported")
        with zf.open(f"{prefix}data.pkl") as fh:
            unpickler = _AllowListUnpickler(fh, source=source, storages=_StorageReader(zf, prefix, source))
            obj = unpickler.load()
    if not isinstance(obj, dict):
        raise ValueError(f"{source}: expected a state dict, got {type(obj).__name__}")
    state = collections.OrderedDict()
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ValueError(f"{source}: entry {key!r} is not a named tensor ({type(value).__name__})")
        state[key] = value
    return state
