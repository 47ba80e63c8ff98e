"""An F32 copy of a quantized GGUF, for a like-for-like fp32 llama.cpp row: every tensor is
dequantized with the ``gguf`` package (the same values tokenmill and transformers dequantize
to) and written with all metadata (tokenizer, chat template, hyper-parameters) unchanged but
``general.file_type`` = ALL_F32. Written once, atomically, next to the source file (the model
cache), then reused."""
from __future__ import annotations

import os
from typing import Optional

FILE_TYPE_ALL_F32 = 0


def f32_path(src: str, cache_dir: Optional[str] = None) -> str:
    stem = os.path.basename(src)[:-len(".gguf")]
    return os.path.join(cache_dir or os.path.dirname(src), f"{stem}.F32.gguf")


def ensure_f32_gguf(src: str, cache_dir: Optional[str] = None) -> str:
    """Path of the F32 copy of ``src``, written on first use."""
    dst = f32_path(src, cache_dir)
    if not os.path.isfile(dst):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        tmp = f"{dst}.tmp{os.getpid()}"
        try:
            write_f32_gguf(src, tmp)
            os.replace(tmp, dst)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return dst


def write_f32_gguf(src: str, dst: str) -> None:
    import gguf
    import numpy as np
    from gguf.quants import dequantize
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue   # written by GGUFWriter itself
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = FILE_TYPE_ALL_F32
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)
    tensors = []
    for t in reader.tensors:
        data = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        tensors.append(data)
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes,
                               gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in tensors:
        writer.write_tensor_data(data)
    writer.close()
