"""Minimal safetensors reader (memory-mapped, slice-on-read, bf16 via ml_dtypes) and writer. The
format: 8-byte little-endian header length, a JSON header `{name: {dtype, shape, data_offsets}}`,
then the raw bytes."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from dmtp_jax.errors import UserError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read or does not fit the model; names the file or tensor."""


class SafetensorsFile:
    """Lazy view of one `.safetensors` file: `f.array(name)` is a read-only memmap."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as fh:
                raw = fh.read(8)
                if len(raw) != 8:
                    raise CheckpointError(f"{path}: file too short to be safetensors")
                (n,) = struct.unpack("<Q", raw)
                header_bytes = fh.read(n)
                if len(header_bytes) != n:
                    raise CheckpointError(f"{path}: truncated safetensors header")
            header = json.loads(header_bytes)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, struct.error) as e:
            raise CheckpointError(f"cannot read safetensors file {path}: {e}") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.header = header
        self.data_start = 8 + n
        self.size = os.path.getsize(path)
        self._mmap = None

    def keys(self):
        return self.header.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def array(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor '{name}' has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        if self.data_start + end > self.size:
            raise CheckpointError(f"{self.path}: tensor '{name}' runs past the end of the file "
                                  "(truncated download?)")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        dtype = DTYPES[info["dtype"]]
        buf = self._mmap[self.data_start + start:self.data_start + end]
        return buf.view(dtype).reshape(info["shape"])


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    """Writes `tensors` (numpy, any dtype in DTYPES) to `path` atomically (temp file + rename)."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    arrays = {}
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"cannot save tensor '{name}' of dtype {arr.dtype}")
        header[name] = {"dtype": DTYPE_NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays[name] = arr
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(header_bytes)))
        fh.write(header_bytes)
        for name in sorted(arrays):
            fh.write(arrays[name].tobytes())
    os.replace(tmp, path)


class CheckpointReader:
    """All tensors of an HF model directory: a single file, shards with an index, or any `*.safetensors`."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        index_path = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            try:
                with open(index_path) as fh:
                    weight_map = json.load(fh)["weight_map"]
            except (OSError, KeyError, json.JSONDecodeError) as e:
                raise CheckpointError(f"cannot read {index_path}: {e}") from None
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(model_dir, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")) \
                if os.path.isdir(model_dir) else []
            if not files:
                raise CheckpointError(f"no safetensors weights in {model_dir}")
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, SafetensorsFile] = {}
        for fname in files:
            path = os.path.join(model_dir, fname)
            if not os.path.isfile(path):
                raise CheckpointError(f"{model_dir}: shard '{fname}' named in the index is missing")
            f = SafetensorsFile(path)
            self.files[fname] = f
            for key in f.keys():
                self.where[key] = f

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def keys(self):
        return self.where.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        self._check(name)
        return self.where[name].shape(name)

    def array(self, name: str) -> np.ndarray:
        self._check(name)
        return self.where[name].array(name)

    def _check(self, name: str):
        if name not in self.where:
            raise CheckpointError(f"{self.model_dir}: missing tensor '{name}'")


def write_sharded(out_dir: str, tensors: dict[str, np.ndarray], max_shard_bytes: int = 2 << 30):
    """Writes `model.safetensors`, or numbered shards plus `model.safetensors.index.json`."""
    os.makedirs(out_dir, exist_ok=True)
    total = sum(np.asarray(t).nbytes for t in tensors.values())
    if total <= max_shard_bytes:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = np.asarray(tensors[name]).nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(out_dir, fname), shard)
        weight_map.update({name: fname for name in shard})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
