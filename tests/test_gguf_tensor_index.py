"""The cached tensor index of a GGUF file (protocol/gguf_tensor_index.py) against gguf's own reader: the
same tensors, types, dimensions and bytes, then no parse on a later start; a stale or broken index is
written anew, and a replaced file gets its own."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

import tandem.protocol.gguf_tensor_index as index_mod
from tandem.protocol.gguf_metadata import metadata_cache_path
from tandem.protocol.gguf_tensor_index import INDEX_FILE, gguf_tensor_index
from tests.gguf_files import QTYPES, write_gguf


def _same_as_reader(path: Path) -> None:
    reader = gguf.GGUFReader(path)
    index = gguf_tensor_index(path)
    assert index.architecture == reader.fields["general.architecture"].contents()
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type and ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape, ours.name
        assert np.array_equal(ours.data, theirs.data, equal_nan=True), ours.name


@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_the_index_gives_what_ggufs_reader_gives(qtype: str, tiny_model, tmp_path: Path) -> None:
    path = write_gguf(tiny_model("qwen3"), tmp_path / f"{qtype}.gguf", qtype)
    _same_as_reader(path)  # written from the reader
    assert (metadata_cache_path(path) / INDEX_FILE).is_file()
    _same_as_reader(path)  # read back from the file


def test_a_later_start_parses_nothing_and_a_bad_index_is_written_anew(
    tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tiny_model("llama"), tmp_path / "m.gguf", "Q4_1")
    gguf_tensor_index(path)
    saved = index_mod.open_gguf

    def no_parse(p):
        raise AssertionError("parsed again")

    monkeypatch.setattr(index_mod, "open_gguf", no_parse)
    assert len(gguf_tensor_index(path).tensors) == len(gguf.GGUFReader(path).tensors)
    monkeypatch.setattr(index_mod, "open_gguf", saved)
    cached = metadata_cache_path(path) / INDEX_FILE
    for bad in ("{not json", json.dumps({"version": 0, "tensors": []})):
        cached.write_text(bad)
        _same_as_reader(path)
        assert json.loads(cached.read_text())["version"] == index_mod._VERSION
    # A file replaced at the same path (another size and time) is indexed anew, not cut by the old offsets.
    other = write_gguf(tiny_model("qwen2"), tmp_path / "other.gguf", "Q8_0")
    shutil.copyfile(other, path)
    os.utime(path, ns=(1, 1))
    _same_as_reader(path)


def test_a_changed_reader_writes_the_metadata_anew(tiny_model, tmp_path: Path, monkeypatch) -> None:
    """The metadata cache is keyed by the reader's code too: a fixed GGUF reader (an upgrade) never serves
    the config an older one wrote for the same file."""
    from tandem.protocol import gguf_metadata

    path = write_gguf(tiny_model("llama"), tmp_path / "m.gguf", "Q8_0")
    before, code = gguf_metadata.metadata_cache_path(path), gguf_metadata.reader_code
    assert code.__wrapped__() == code()  # a hash of the files, the same each time it is taken
    monkeypatch.setattr(gguf_metadata, "reader_code", lambda: "another reader")
    assert gguf_metadata.metadata_cache_path(path) != before
