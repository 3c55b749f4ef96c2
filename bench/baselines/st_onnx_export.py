"""Once, before bench/baselines/st_onnx_int8.py runs: copy the model and add sentence-transformers' own
dynamic-quantized int8 ONNX export to it, for this CPU's instruction set (avx512_vnni, else avx2).

    python bench/baselines/st_onnx_export.py source_model_dir target_dir
"""

import shutil
import sys
from pathlib import Path

from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model

if __name__ == "__main__":
    source, target = Path(sys.argv[1]), Path(sys.argv[2])
    if not any(target.glob("onnx/model_qint8_*.onnx")):
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)
        flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        config = "avx512_vnni" if "avx512_vnni" in flags else "avx2"
        model = SentenceTransformer(str(target), backend="onnx", device="cpu")  # exports onnx/model.onnx
        model.save_pretrained(str(target))
        export_dynamic_quantized_onnx_model(model, config, str(target))
    print(next(target.glob("onnx/model_qint8_*.onnx")))
