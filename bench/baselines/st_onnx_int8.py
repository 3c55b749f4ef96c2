"""What an informed user writes instead of tokenmill's int8 tier: sentence-transformers' own ONNX backend
with its dynamic-quantized int8 export, read Parquet, encode, write Parquet.

    python bench/baselines/st_onnx_int8.py in.parquet out.parquet model_dir

model_dir holds the model with `onnx/model_qint8_<isa>.onnx` beside it, made once beforehand by
`export_dynamic_quantized_onnx_model` (bench/cheap_tier.py does it, untimed, as a user would once).
It runs in its own environment (sentence-transformers with optimum[onnxruntime]), as such a script would.
"""

import json
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from sentence_transformers import SentenceTransformer

if __name__ == "__main__":
    source, target, model_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    table = pq.read_table(source, columns=["id", "text"])
    file_name = next(Path(model_dir, "onnx").glob("model_qint8_*.onnx")).name
    model = SentenceTransformer(model_dir, backend="onnx", device="cpu", model_kwargs={"file_name": f"onnx/{file_name}"})
    started = time.perf_counter()
    vectors = model.encode(table.column("text").to_pylist(), batch_size=32)
    encode_seconds = time.perf_counter() - started
    pq.write_table(pa.table({"id": table.column("id"), "embedding": list(vectors)}), target)
    print(json.dumps({"engine_seconds": encode_seconds}))
