"""Where each tensor of a GGUF file lies, kept beside its cached metadata files (gguf_metadata.py).

gguf's reader finds the tensors only after parsing every metadata field, and a 262k-token vocabulary takes it
over ten seconds, at every worker start. What it finds (each tensor's name, type, dimensions, offset and the
array it makes of the bytes) is written once as `tensors.json`; later starts map the file and cut the same
views from it, with no parse.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tandem.protocol.gguf_metadata import metadata_cache_path, open_gguf

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType, GGUFReader

INDEX_FILE = "tensors.json"
# Linux 5.14's madvise(MADV_POPULATE_READ): map every page of the range in one call. Reading a mapped file
# otherwise takes one fault per 4 KiB page: ~0.5 s of the 0.6 s a 1B Q4_K_M file's bytes took to copy.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_VERSION = 1  # bumped when the file's layout changes: an older one is written anew


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as gguf's reader gives it: `shape` innermost dimension first (GGUF's order), `data` the
    reader's view of its bytes (quantized types: uint8 rows of blocks)."""

    name: str
    type_name: str  # GGMLQuantizationType's name, e.g. "Q4_K"
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def tensor_type(self) -> GGMLQuantizationType:
        import gguf

        return gguf.GGMLQuantizationType[self.type_name]


@dataclass(frozen=True)
class GGUFTensorIndex:
    architecture: str
    tensors: list[GGUFTensor]
    mapping: mmap.mmap | None = None  # the file, read-only, that every tensor's data views

    def populate(self) -> None:
        """Map the whole file's pages now, for a reader of every byte (the worker's load). Best effort: an
        older kernel refuses (EINVAL) and the pages fault in as they are read."""
        if self.mapping is not None and hasattr(self.mapping, "madvise"):
            with contextlib.suppress(OSError):
                self.mapping.madvise(_MADV_POPULATE_READ)


def _entries(reader: GGUFReader) -> dict[str, Any]:
    arch = reader.fields.get("general.architecture")
    return {
        "version": _VERSION,
        "architecture": arch.contents() if arch is not None else None,
        "tensors": [
            [
                t.name,
                t.tensor_type.name,
                [int(d) for d in t.shape],
                int(t.data_offset),
                t.data.dtype.str,
                list(t.data.shape),
            ]
            for t in reader.tensors
        ],
    }


def write_tensor_index(reader: GGUFReader, out: Path) -> None:
    """Write the index of `reader`'s file into the directory `out` (atomically: readers race)."""
    out.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=out)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(_entries(reader), f)
    os.replace(tmp, out / INDEX_FILE)


FLOAT_GGUF_TYPES = ("F32", "F16", "BF16")  # a file of these holds a float checkpoint, not blocks


def gguf_linear_type(path: str | Path) -> str:
    """The type of a GGUF file's linear weights, as its first layer's attention output holds them (e.g.
    "BF16", "Q4_K"): the type a file is named by (a mixed file's other tensors take neighbouring types)."""
    index = gguf_tensor_index(path)
    found = next((t for t in index.tensors if t.name == "blk.0.attn_output.weight"), None)
    if found is None:
        found = next(t for t in index.tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    return found.type_name


def gguf_tensor_index(path: str | Path) -> GGUFTensorIndex:
    """The file's tensors, from the cached index (written from gguf's reader when absent)."""
    p = Path(path).resolve()
    d = metadata_cache_path(p)
    try:
        entries = json.loads((d / INDEX_FILE).read_text(encoding="utf-8"))
        if entries.get("version") != _VERSION:
            raise ValueError("an older index")
    except (OSError, ValueError):
        reader = open_gguf(p)
        write_tensor_index(reader, d)
        entries = _entries(reader)
        del reader
    with open(p, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    raw = np.frombuffer(mapping, dtype=np.uint8)
    tensors = []
    for name, type_name, shape, offset, dtype, data_shape in entries["tensors"]:
        dt = np.dtype(dtype)
        n_bytes = int(np.prod(data_shape, dtype=np.int64)) * dt.itemsize
        tensors.append(GGUFTensor(name, type_name, tuple(shape),
                                  raw[offset : offset + n_bytes].view(dt).reshape(data_shape)))
    return GGUFTensorIndex(entries["architecture"], tensors, mapping)
