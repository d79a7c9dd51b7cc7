"""`python -m benchmarks.gguf_to_f32 IN.gguf OUT.gguf`: the same model with every tensor dequantized to
float32, every metadata key kept (file type set to all-F32).

llama.cpp's float32 figures (llama-bench, llama-server) need an F32 GGUF of the weights tandem's float32
directory holds (`tandem convert` of the same file): both are the quantized file's values, dequantized by
the `gguf` package, so the two engines run the same numbers.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np


def to_f32(src: Path, dst: Path) -> Path:
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) or field.name.startswith("GGUF."):
            continue  # the writer writes the first and the last itself; the file type is new
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        writer.add_tensor(t.name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    a = ap.parse_args()
    print(to_f32(a.src, a.dst))


if __name__ == "__main__":
    main()
