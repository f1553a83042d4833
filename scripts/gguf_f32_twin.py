#!/usr/bin/env python3
"""Write the F32 twin of a GGUF: the same metadata, every tensor as the F32 values its blocks decode to
(gguf-py's dequantization, llama.cpp's formulas). A quantized file and its twin hold the same weights, so an
engine that decodes the blocks exactly gives both the same logits.

    python3 scripts/gguf_f32_twin.py model-q4_k_m.gguf model-q4_k_m-f32.gguf      (needs numpy and gguf)
"""
import sys

import gguf
import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    r = GGUFReader(sys.argv[1])
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(sys.argv[2], arch=arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt = f.types[0]
        if vt == GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), vt)
    for t in r.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, x.reshape(tuple(int(d) for d in reversed(t.shape))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
