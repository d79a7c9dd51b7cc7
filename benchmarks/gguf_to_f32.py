"""`python -m tandem.benchmarks.gguf_to_f32 IN.gguf OUT.gguf [--bf16]`: the same model with every tensor
dequantized
to float32, every metadata key kept (file type set to all-F32); with --bf16 the matrices then rounded to
bfloat16 (the vectors stay float32, as llama.cpp's converter leaves them; file type mostly-BF16).

llama.cpp's float32 figures (llama-bench, llama-server) need an F32 GGUF of the weights tandem's float32
directory holds (`tandem convert` of the same file): both are the quantized file's values, dequantized by
the `gguf` package, so the two engines run the same numbers. The BF16 file holds what tandem multiplies with
under `--dtype auto` on a CPU with bf16 matmuls (the directory's matrices rounded to bf16).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np


def to_f32(src: Path, dst: Path, bf16: bool = False) -> Path:
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name in (
            gguf.Keys.General.ARCHITECTURE,
            gguf.Keys.General.FILE_TYPE,
        ) or field.name.startswith("GGUF."):
            continue  # the writer writes the first and the last itself; the file type is new
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        values = np.ascontiguousarray(
            gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        )
        if bf16 and values.ndim >= 2:
            bf = gguf.GGMLQuantizationType.BF16
            writer.add_tensor(t.name, gguf.quants.quantize(values, bf), raw_dtype=bf)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--bf16", action="store_true", help="matrices rounded to bfloat16")
    a = ap.parse_args()
    print(to_f32(a.src, a.dst, a.bf16))


if __name__ == "__main__":
    main()
