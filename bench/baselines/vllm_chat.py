"""What a team writes instead of tokenmill for generation: every prompt in one LLM.chat call.

    python bench/baselines/vllm_chat.py in.parquet out.parquet model_path max_tokens template
"""

import json
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
from vllm import LLM, SamplingParams

if __name__ == "__main__":  # vLLM spawns its engine process
    source, target, model_path, max_tokens, template = sys.argv[1:6]
    table = pq.read_table(source, columns=["id", "text"])
    import torch

    on_gpu = torch.cuda.is_available()  # on CPU: fp32 (bf16 is far slower there) and 30% of RAM for the KV cache
    llm = LLM(model=model_path, dtype="auto" if on_gpu else "float32", gpu_memory_utilization=0.9 if on_gpu else 0.3,
              max_num_seqs=256)
    conversations = [[{"role": "user", "content": template.replace("{text}", text)}]
                     for text in table.column("text").to_pylist()]
    started = time.perf_counter()
    outputs = llm.chat(conversations, SamplingParams(max_tokens=int(max_tokens), temperature=0.0, seed=0),
                       use_tqdm=False)
    engine_seconds = time.perf_counter() - started
    pq.write_table(pa.table({"id": table.column("id"), "output_text": [o.outputs[0].text for o in outputs]}), target)
    figures = {"engine_seconds": engine_seconds, "input_tokens": sum(len(o.prompt_token_ids) for o in outputs),
               "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}
    llm.llm_engine.engine_core.shutdown()  # what the script's author would do; its log lines go to stdout too
    print(json.dumps(figures), flush=True)
