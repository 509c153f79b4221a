"""Safetensors checkpoint access and the strict tensor check (MODEL.md §2.1, §2.5).

    ckpt = open_safetensors(checkpoint_dir)       # index + shard headers only, no tensor data
    ckpt.shape_of(name), ckpt.dtype_of(name)      # from the headers
    ckpt.get(name)                                # memory-mapped read of one tensor, stored dtype
    ckpt.read_parallel(names, fn, device=...)     # fn(name, mapped, copier) from a thread per shard
    check_tensors(ckpt, expected, other_stage_names=...)   # one WeightError listing every problem

Problems are collected, never raised one at a time: a real checkpoint whose names or shapes differ
from ours should come back as one list that names each tensor and its shard file.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from services.common.config import DramaConfig
from services.common.inventory import (
    BACKBONE_PREFIX,
    F32_OR_BF16,
    IGNORED_PREFIXES,
    TEXT_ONLY_PREFIX,
    TensorSpec,
    backbone_inventory,
    is_ignored,
    tower_inventory,
    tower_optional_inventory,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class WeightError(ValueError):
    """Everything wrong with a checkpoint's tensors, as one error. `.problems` lists the lines."""

    def __init__(self, problems: list[str], where: str = "checkpoint"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in {where}:\n{lines}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SafetensorsCheckpoint:
    """Lazy view of a sharded (or single-file) safetensors checkpoint.

    Shard headers are read when the checkpoint is opened (to check the index against the shards);
    tensor data is memory-mapped by `safe_open` and read only by `get`.
    """

    def __init__(self, directory: Path, weight_map: dict[str, str], index_name: str):
        self.directory = Path(directory)
        self.index_name = index_name     # the file that lists the tensors, for messages
        self._weight_map = dict(weight_map)
        self._handles: dict[str, object] = {}
        self._headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
        problems = []
        for shard in sorted(set(self._weight_map.values())):
            path = self.directory / shard
            if not path.is_file():
                problems.append(f"shard file {shard} is listed in {index_name} but does not exist")
                continue
            try:
                self._headers[shard] = _read_header(path)
            except ValueError as exc:
                problems.append(f"{shard}: {exc}")
        for name, shard in self._weight_map.items():
            if shard in self._headers and name not in self._headers[shard]:
                problems.append(f"{name}: listed in {index_name} under {shard}, but {shard} does not contain it")
        for shard, header in self._headers.items():
            for name in header:
                if self._weight_map.get(name) != shard:
                    problems.append(f"{name}: stored in {shard} but {index_name} does not map it there")
        if problems:
            raise WeightError(problems, f"checkpoint index {self.directory / index_name}")

    # ---- queries (headers only) ----
    def names(self) -> list[str]:
        return list(self._weight_map)

    keys = names   # the safetensors.safe_open spelling

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def __len__(self) -> int:
        return len(self._weight_map)

    def file_of(self, name: str) -> str:
        try:
            return self._weight_map[name]
        except KeyError:
            raise KeyError(f"{name}: not in {self.index_name}") from None

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._headers[self.file_of(name)][name][1]

    def dtype_of(self, name: str) -> torch.dtype:
        code = self._headers[self.file_of(name)][name][0]
        try:
            return SAFETENSORS_DTYPES[code]
        except KeyError:
            raise ValueError(f"{name} in {self.file_of(name)}: unsupported dtype {code}") from None

    def nbytes_of(self, name: str) -> int:
        return math.prod(self.shape_of(name)) * torch.empty(0, dtype=self.dtype_of(name)).element_size()

    # ---- data ----
    def get(self, name: str) -> torch.Tensor:
        """One tensor in its stored dtype (memory-mapped; copy it before writing to it)."""
        shard = self.file_of(name)
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.directory / shard), framework="pt")
        return self._handles[shard].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()

    def read_parallel(self, names: Iterable[str], fn: Callable[[str, torch.Tensor, "DeviceCopier"], None],
                      *, device: str | torch.device = "cpu", threads: int | None = None,
                      sync_device: bool = True) -> None:
        """Call `fn(name, mapped, copier)` for every name, from a pool of threads.

        Each thread takes one shard at a time, opens its own memory map of it, asks the kernel to
        read the byte ranges of the wanted tensors ahead (POSIX_FADV_WILLNEED: large reads queued
        at once instead of one page fault at a time) and calls `fn` for them in file order.
        `mapped` is the stored tensor as a read-only view of the map, valid during the call only:
        `fn` copies what it keeps, with `copier` (this thread's DeviceCopier for `device`). Reads
        happen in the copies (the page faults), and the copies release the GIL, so the threads
        read shards in parallel. `fn` runs on the pool's threads: it must only write to places
        no other call writes (its own dict key, its own slice of a preallocated tensor).
        Returns when every copy has landed (CUDA: each reader waits for its copy stream, then,
        with sync_device, the whole device); the first exception raised by any call is raised here.
        threads: default $DRAMA_LOAD_THREADS, else min(8, cores, shards). sync_device=False for
        reads that run while another thread captures a CUDA graph (a device-wide synchronize
        would break the capture).
        """

        def read_shard(path: Path, spans: list[tuple[int, int, str]], copier: DeviceCopier) -> None:
            handle = safe_open(str(path), framework="pt")
            for _, _, name in spans:
                fn(name, handle.get_tensor(name), copier)

        self._each_shard(names, read_shard, torch.device(device), threads, sync_device)

    def read_into_parallel(self, targets: Mapping[str, torch.Tensor], *, device: str | torch.device = "cpu",
                           threads: int | None = None, sync_device: bool = True) -> None:
        """Copy each stored tensor `name` into `targets[name]`, a contiguous tensor on `device`
        of its stored shape and dtype (a slice of a preallocated stack), from a pool of threads.

        Tensors that lie next to each other in a shard travel together: a run of them (at most
        DeviceCopier.chunk_bytes, gaps under RUN_GAP_BYTES included) is one copy out of the
        shard's memory map (the page faults, the disk reads, with the GIL released) and, on
        CUDA, one host-to-device copy, then one multi-tensor copy puts each tensor's bytes in
        place. Why not `read_parallel`: a full checkpoint's ~61k routed-expert tensors (~0.5 MB
        each) cost ~100 µs of Python each there, under a GIL that the start shares with the
        warm-up's graph captures (weights.start_backbone_load); here that is a few µs per tensor
        and ~10 launches per run. Threads, sync_device and errors as in `read_parallel`.
        """
        device = torch.device(device)
        problems = []
        for name, target in targets.items():
            if (target.dtype != self.dtype_of(name) or tuple(target.shape) != tuple(self.shape_of(name))
                    or not target.is_contiguous() or target.device.type != device.type):
                problems.append(f"{name} ({self.file_of(name)}): stored {dtype_name(self.dtype_of(name))} "
                                f"{list(self.shape_of(name))}, target {dtype_name(target.dtype)} "
                                f"{list(target.shape)} on {target.device} (contiguous: {target.is_contiguous()})")
        if problems:
            raise WeightError(problems, f"checkpoint {self.directory}")

        def read_shard(path: Path, spans: list[tuple[int, int, str]], copier: DeviceCopier) -> None:
            with open(path, "rb") as fh:
                # a private map, unmapped when dropped: its pages are the page cache's until written,
                # and nothing writes them (a read-only map works too, but torch.frombuffer warns on
                # it, and silencing that is not thread-safe)
                shard_bytes = torch.frombuffer(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
            for begin, end, run in _runs(spans, copier.chunk_bytes):
                parts = [(b - begin, targets[n].reshape(-1).view(torch.uint8)) for b, _, n in run]
                copier.copy_parts(shard_bytes[begin:end], parts)

        self._each_shard(list(targets), read_shard, device, threads, sync_device)

    def _each_shard(self, names: Iterable[str],
                    read_shard: Callable[[Path, list[tuple[int, int, str]], "DeviceCopier"], None],
                    device: torch.device, threads: int | None, sync_device: bool) -> None:
        """What read_parallel and read_into_parallel share: for every shard holding some of
        `names`, on a pool of threads (default `default_read_threads`; biggest shards first, so a
        big last shard is not the tail), the byte ranges of its wanted tensors are asked ahead
        (`_read_ahead`) and `read_shard(path, spans, copier)` runs with the spans (file begin,
        end, name) in file order and the thread's DeviceCopier, which it then waits for. The
        first exception is raised here, and the shards not started are dropped. On CUDA with
        sync_device, the device is synchronised at the end."""
        by_shard: dict[str, list[str]] = {}
        for name in names:
            by_shard.setdefault(self.file_of(name), []).append(name)
        if not by_shard:
            return
        local = threading.local()

        def run(shard: str) -> None:
            path = self.directory / shard
            data_start, offsets = _data_offsets(path)
            spans = sorted((data_start + offsets[n][0], data_start + offsets[n][1], n) for n in by_shard[shard])
            _read_ahead(path, [(begin, end) for begin, end, _ in spans])
            copier = getattr(local, "copier", None)
            if copier is None:
                copier = local.copier = DeviceCopier(device)
            try:
                read_shard(path, spans, copier)
            finally:
                copier.finish()

        threads = threads or default_read_threads(len(by_shard))
        order = sorted(by_shard, key=lambda f: -sum(self.nbytes_of(n) for n in by_shard[f]))
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-read") as pool:
            futures = [pool.submit(run, shard) for shard in order]
            wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                if future.done() and future.exception() is not None:
                    for other in futures:
                        other.cancel()
                    raise future.exception()
        if device.type == "cuda" and sync_device:
            torch.cuda.synchronize(device)


# Bytes between two tensors a run of read_into_parallel reads over rather than starting a new run
RUN_GAP_BYTES = 2 ** 20


def _runs(spans: list[tuple[int, int, str]], most: int, gap: int = RUN_GAP_BYTES):
    """(begin, end, spans) runs of the sorted (begin, end, name) spans: neighbours less than
    `gap` apart, at most `most` bytes from the first begin to the last end (a longer tensor is a
    run of its own)."""
    run: list[tuple[int, int, str]] = []
    for span in spans:
        if run and (span[0] - run[-1][1] >= gap or span[1] - run[0][0] > most):
            yield run[0][0], run[-1][1], run
            run = []
        run.append(span)
    if run:
        yield run[0][0], run[-1][1], run


def default_read_threads(shards: int) -> int:
    """$DRAMA_LOAD_THREADS, else min(8, cores, shards): 8 readers keep a disk's queue and the
    host-to-GPU copies busy; more only add memory traffic."""
    configured = int(os.environ.get("DRAMA_LOAD_THREADS", "0") or 0)
    return max(1, configured or min(8, os.cpu_count() or 1, shards))


def _data_offsets(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(where the data starts, name -> [begin, end) byte offsets in the data) from a safetensors
    header (an 8-byte little-endian length, then that much JSON). The file was already validated
    by safe_open when the checkpoint was opened."""
    with open(path, "rb") as fh:
        length = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(length))
    return 8 + length, {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}


def _read_ahead(path: Path, ranges: list[tuple[int, int]], gap: int = 2 ** 20) -> None:
    """POSIX_FADV_WILLNEED over `ranges` (file byte ranges, sorted), merged where less than `gap`
    apart. Advice only: where the call is missing or refused, the page faults read instead."""
    if not ranges or not hasattr(os, "posix_fadvise"):
        return
    merged = [list(ranges[0])]
    for begin, end in ranges[1:]:
        if begin - merged[-1][1] < gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    fd = os.open(path, os.O_RDONLY)
    try:
        for begin, end in merged:
            os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


class DeviceCopier:
    """Copies host tensors (memory-mapped shard views) to `device`; one per reading thread.

    CPU (and any device but CUDA): `src.to(dtype, copy=True)` / `dst.copy_(src)`, one pass that
    converts the dtype on the way and always gives fresh memory, never a view of the map.

    CUDA: through two pinned staging buffers used in turn. The CPU fills one from the map (this
    is where the page faults, i.e. the disk reads, happen: in parallel across threads) while
    this thread's own stream copies the other to the GPU asynchronously; a buffer is refilled
    only after the event recorded behind its last copy has completed. Destinations are
    allocated on the thread's current (default) stream, and the copy stream first waits for
    that stream, so a reused block is never written while older work may still read it.
    `finish()` waits for the copy stream. A dtype change happens on the GPU, after the copy.
    """

    CHUNK_BYTES = 32 * 2 ** 20   # x2 buffers x threads of pinned memory; 32 MiB copies run at full speed

    def __init__(self, device: str | torch.device, chunk_bytes: int | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.chunk_bytes = chunk_bytes or self.CHUNK_BYTES
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self.staging = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self.pending: list[torch.cuda.Event | None] = [None, None]
            self.turn = 0
            self.device_staging: list[torch.Tensor] | None = None    # copy_parts' buffers, made on first use

    def new(self, src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A fresh copy of `src` on the device, in `dtype` (default: src's)."""
        dtype = dtype or src.dtype
        if not self.cuda:
            return src.to(device=self.device, dtype=dtype, copy=True)
        out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        self._staged_copy(out, src)
        if dtype == src.dtype:
            return out
        return self._landed(out).to(dtype)

    def _landed(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` once the copy stream's work has finished, for use on the current stream.
        Only the rare dtype change needs this (F32 stored, BF16 computed)."""
        self.stream.synchronize()
        return tensor

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` into the existing device tensor `dst` (same shape), converting the dtype."""
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"copy of {tuple(src.shape)} into {tuple(dst.shape)}")
        if not self.cuda:
            dst.copy_(src)
        elif dst.dtype == src.dtype:
            self._staged_copy(dst, src)
        else:
            dst.copy_(self._landed(self.new(src)))   # lands in the stored dtype, converts on the GPU

    def _staged_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        nbytes = src.numel() * src.element_size()
        if nbytes == 0:
            return
        if not (dst.is_contiguous() and src.is_contiguous()) or dst.dtype != src.dtype:
            raise ValueError("staged copies need contiguous tensors of one dtype")
        src_bytes = src.reshape(-1).view(torch.uint8)
        dst_bytes = dst.reshape(-1).view(torch.uint8)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for begin in range(0, nbytes, self.chunk_bytes):
            end = min(begin + self.chunk_bytes, nbytes)
            turn, buffer = self._pinned(src_bytes[begin:end])
            with torch.cuda.stream(self.stream):
                dst_bytes[begin:end].copy_(buffer, non_blocking=True)
                self.pending[turn] = self.stream.record_event()

    def _pinned(self, src_bytes: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(turn, buffer): `src_bytes` (1-D uint8 on the host, at most chunk_bytes) copied into
        the next pinned staging buffer, once that buffer's previous copy to the device has left it.
        The caller starts the buffer's copy on the copy stream and records it in pending[turn]."""
        turn = self.turn
        self.turn ^= 1
        if self.pending[turn] is not None:
            self.pending[turn].synchronize()
        buffer = self.staging[turn][: src_bytes.numel()]
        buffer.copy_(src_bytes)                           # host: reads the shard
        return turn, buffer

    def copy_parts(self, src: torch.Tensor, parts: list[tuple[int, torch.Tensor]]) -> None:
        """Copy src[offset : offset + len(dst)] into each dst, for the (offset, dst) parts: `src`
        a 1-D uint8 host tensor (a run of a shard's bytes), each dst a 1-D uint8 view of a
        contiguous tensor on the device. On CUDA `src` goes through a pinned staging buffer and a
        device staging buffer (used in turn, as `_staged_copy`'s) in one copy each, then one
        multi-tensor copy on the copy stream scatters it; a run longer than chunk_bytes (one big
        tensor) takes `_staged_copy` instead. Elsewhere one multi-tensor copy from `src`."""
        targets = [dst for _, dst in parts]
        if not self.cuda:
            torch._foreach_copy_(targets, [src[offset:offset + dst.numel()] for offset, dst in parts])
            return
        if src.numel() > self.chunk_bytes:
            for offset, dst in parts:
                self._staged_copy(dst, src[offset:offset + dst.numel()])
            return
        if self.device_staging is None:
            with torch.cuda.stream(self.stream):     # the buffers belong to the copy stream
                self.device_staging = [torch.empty(self.chunk_bytes, dtype=torch.uint8, device=self.device)
                                       for _ in range(2)]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        turn, pinned = self._pinned(src)
        with torch.cuda.stream(self.stream):
            landed = self.device_staging[turn][: src.numel()]
            landed.copy_(pinned, non_blocking=True)
            self.pending[turn] = self.stream.record_event()
            # the same stream scatters it, and refills this device buffer only after that
            torch._foreach_copy_(targets, [landed[offset:offset + dst.numel()] for offset, dst in parts])

    def finish(self) -> None:
        """Wait until every copy this copier started has landed."""
        if self.cuda:
            self.stream.synchronize()


def _read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype code, shape) from a safetensors header, without touching the data. A file
    safetensors refuses (a bad header, data shorter than the header says: a truncated copy)
    raises ValueError with its reason."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            out = {}
            for name in fh.keys():
                piece = fh.get_slice(name)
                out[name] = (piece.get_dtype(), tuple(piece.get_shape()))
            return out
    except SafetensorError as exc:
        raise ValueError(f"not a readable safetensors file: {exc}") from None


def open_safetensors(directory: str | Path) -> SafetensorsCheckpoint:
    """Open `model.safetensors.index.json` (its weight_map) or else a single `model.safetensors`."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            raw = json.loads(index.read_text(encoding="utf-8"))
            weight_map = raw["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightError([f"{INDEX_FILE}: unreadable index ({exc!r})"], str(directory)) from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise WeightError([f"{INDEX_FILE}: weight_map must map tensor names to file names"],
                              str(directory))
        return SafetensorsCheckpoint(directory, weight_map, INDEX_FILE)
    single = directory / SINGLE_FILE
    if single.is_file():
        try:
            names = _read_header(single)
        except ValueError as exc:
            raise WeightError([f"{SINGLE_FILE}: {exc}"], str(directory)) from None
        return SafetensorsCheckpoint(directory, {n: SINGLE_FILE for n in names}, SINGLE_FILE)
    raise WeightError([f"neither {INDEX_FILE} nor {SINGLE_FILE} exists"], str(directory))


def _fp8_stand_in(name: str, spec: TensorSpec, stored: torch.dtype) -> bool:
    """MODEL.md §2.5 rule 4: any BF16 linear weight may be stored FP8 (with a scale sibling)."""
    return (stored == torch.float8_e4m3fn and name.endswith(".weight") and len(spec.shape) == 2
            and torch.bfloat16 in spec.dtypes and not name.endswith("embeddings.weight")
            and not name.endswith("embed_tokens.weight"))


def find_tensor_problems(ckpt: SafetensorsCheckpoint, expected: Mapping[str, TensorSpec], *,
                         ignore_prefixes: Iterable[str] = IGNORED_PREFIXES,
                         other_stage_names: Iterable[str] = (),
                         optional: Mapping[str, TensorSpec] | None = None,
                         block_size: tuple[int, int] = (128, 128)) -> list[str]:
    """Every missing, unexpected, mis-shaped and wrong-dtype tensor, one line each with its file.

    expected: this stage's tensors; optional: tensors that may be absent but must match when
    present; other_stage_names: names another stage claims (neither checked nor unexpected here).
    """
    optional = dict(optional or {})
    other = set(other_stage_names)
    present = set(ckpt.names())
    problems = []
    fp8_scales = set()   # scale siblings of BF16 linears stored as FP8 (rule 4)

    for name, spec in {**expected, **optional}.items():
        if name not in present:
            if name in expected:
                problems.append(f"missing: {name} (expected {spec}; not in {ckpt.index_name})")
            continue
        shard, shape, dtype = ckpt.file_of(name), ckpt.shape_of(name), ckpt.dtype_of(name)
        if shape != spec.shape:
            problems.append(f"wrong shape: {name} in {shard} is {list(shape)}, expected {list(spec.shape)}")
        if dtype in spec.dtypes:
            continue
        if _fp8_stand_in(name, spec, dtype) and f"{name}_scale_inv" not in expected:
            fp8_scales.add(f"{name}_scale_inv")
            problems.extend(_scale_problems(ckpt, f"{name}_scale_inv", spec.shape, block_size))
            continue
        allowed = "/".join(dtype_name(d) for d in spec.dtypes)
        problems.append(f"wrong dtype: {name} in {shard} is {dtype_name(dtype)}, expected {allowed}")

    known = set(expected) | set(optional) | other | fp8_scales
    for name in ckpt.names():
        if name in known or is_ignored(name, ignore_prefixes):
            continue
        if name.endswith(".weight_scale_inv") and name.removesuffix("_scale_inv") in other:
            continue   # the scale of another stage's FP8 weight: that stage checks it
        if name.endswith(".weight_scale_inv") and name.removesuffix("_scale_inv") in present:
            problems.append(f"unexpected: {name} in {ckpt.file_of(name)} (a scale whose weight "
                            f"{name.removesuffix('_scale_inv')} is not FP8)")
        else:
            problems.append(f"unexpected: {name} in {ckpt.file_of(name)} "
                            f"({list(ckpt.shape_of(name))} {dtype_name(ckpt.dtype_of(name))})")
    return problems


def _scale_problems(ckpt: SafetensorsCheckpoint, scale: str, weight_shape: tuple[int, ...],
                    block_size: tuple[int, int]) -> list[str]:
    want = tuple(math.ceil(n / b) for n, b in zip(weight_shape, block_size))
    if scale not in ckpt:
        return [f"missing: {scale} (the FP8 weight needs a {list(want)} scale; not in {ckpt.index_name})"]
    out = []
    if ckpt.shape_of(scale) != want:
        out.append(f"wrong shape: {scale} in {ckpt.file_of(scale)} is {list(ckpt.shape_of(scale))}, "
                   f"expected {list(want)}")
    if ckpt.dtype_of(scale) not in F32_OR_BF16:
        out.append(f"wrong dtype: {scale} in {ckpt.file_of(scale)} is {dtype_name(ckpt.dtype_of(scale))}, "
                   f"expected float32/bfloat16")
    return out


def check_tensors(ckpt: SafetensorsCheckpoint, expected: Mapping[str, TensorSpec], *,
                  ignore_prefixes: Iterable[str] = IGNORED_PREFIXES,
                  other_stage_names: Iterable[str] = (),
                  optional: Mapping[str, TensorSpec] | None = None,
                  block_size: tuple[int, int] = (128, 128)) -> None:
    """Raise one WeightError listing every problem find_tensor_problems reports (or return None)."""
    problems = find_tensor_problems(ckpt, expected, ignore_prefixes=ignore_prefixes,
                                    other_stage_names=other_stage_names, optional=optional,
                                    block_size=block_size)
    if problems:
        raise WeightError(problems, f"checkpoint {ckpt.directory}")


# --------------------------------------------------------------------------------------------
# per-stage checks
# --------------------------------------------------------------------------------------------

STAGES = ("backbone", "tower")


def detect_backbone_layout(ckpt: SafetensorsCheckpoint) -> dict:
    """backbone_inventory keyword arguments that fit `ckpt`: its prefix (§2.5 rule 2) and its
    routed-expert layout (rule 3: per-expert FP8 or BF16, or fused BF16)."""
    names = ckpt.names()
    prefixes = [p for p in (BACKBONE_PREFIX, TEXT_ONLY_PREFIX)
                if f"{p}embed_tokens.weight" in ckpt]
    if len(prefixes) != 1:
        raise WeightError([f"expected exactly one backbone prefix ({BACKBONE_PREFIX!r} or "
                           f"{TEXT_ONLY_PREFIX!r}) to hold embed_tokens.weight, found {prefixes or 'none'}"],
                          f"checkpoint {ckpt.directory}")
    prefix = prefixes[0]
    fused = any(n.startswith(prefix) and n.endswith("mlp.experts.gate_up_proj") for n in names)
    probe = f"{prefix}layers.0.mlp.experts.0.gate_proj.weight"
    fp8 = probe not in ckpt or ckpt.dtype_of(probe) == torch.float8_e4m3fn
    return {"prefix": prefix, "fp8_experts": fp8, "fused_experts": fused}


def stage_expectations(ckpt: SafetensorsCheckpoint, cfg: DramaConfig, stage: str
                       ) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec], set[str]]:
    """(expected, optional, names claimed by the other stage) for `stage` of MODEL.md §2.5 rule 6."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    backbone = backbone_inventory(cfg, **detect_backbone_layout(ckpt))
    tower, tower_optional = tower_inventory(cfg), tower_optional_inventory(cfg)
    if stage == "backbone":
        return backbone, {}, set(tower) | set(tower_optional)
    return tower, tower_optional, set(backbone)


def check_stage(ckpt: SafetensorsCheckpoint, cfg: DramaConfig, stage: str) -> None:
    """The strict check of one stage's tensors; the other stage's names are neither missing nor
    unexpected here, so each stage's check still covers the whole index."""
    expected, optional, other = stage_expectations(ckpt, cfg, stage)
    block = tuple(cfg.quantization_config.weight_block_size) if cfg.quantization_config else (128, 128)
    check_tensors(ckpt, expected, optional=optional, other_stage_names=other, block_size=block)
