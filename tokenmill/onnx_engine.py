"""The ONNX Runtime engine: embedding models exported to ONNX, in float32 or quantized (int8, int4).

It is the cheap tier on CPU: ONNX Runtime's int8 kernels run u8 x s8 products where torch's dynamic
int8 saturates, so an int8 MiniLM embeds long documents about 1.7x as fast as float32 on a 2-core
VNNI CPU at cosine 0.994 to it (bench/FINDINGS.md). A job never runs a quantized model unless it
asks to or the eval gate passed it (tokenmill.gate): `engine: auto` never swaps precision.

Batches are padded as the runner cuts them (length buckets), and pooled as sentence-transformers
would (tokenmill.embedding). On CPU, two batches run at once, each on a share of the cores, as the
transformers engine does. Embedding only: generation is vLLM's or transformers'.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np

from tokenmill.embedding import cpu_streams, padded_arrays, pool, read_pooling, usable_cores
from tokenmill.engine_protocol import Engine
from tokenmill.onnx_models import onnx_model
from tokenmill.spec import CPU_TOKEN_BUDGET, GenerationParams, JobSpec

log = logging.getLogger(__name__)


class OnnxEngine(Engine):
    name = "onnxruntime"

    def __init__(self, model_path: str, spec: JobSpec):
        if spec.mode != "embed":
            raise ValueError("the onnxruntime engine embeds; generation runs on vllm or transformers")
        started = time.perf_counter()
        import onnxruntime

        from tokenmill.models import load_text_tokenizer

        self.onnxruntime = onnxruntime
        self.model_file = onnx_model(model_path, spec.model.quantization, spec.model_name)
        tokenizer = load_text_tokenizer(model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.pooling = read_pooling(model_path)
        self.quantization = spec.model.quantization
        self.cores = usable_cores()
        self.streams = cpu_streams(spec, "cpu", self.cores)
        self.session = self._session(self.streams)
        self.default_token_budget = CPU_TOKEN_BUDGET
        self.start_seconds = time.perf_counter() - started
        log.info("Started onnxruntime %s (%s) in %.1f s, %d batch(es) at once", self.model_file,
                 self.quantization or "float32", self.start_seconds, self.streams)

    def _session(self, streams: int):
        options = self.onnxruntime.SessionOptions()
        options.intra_op_num_threads = max(1, self.cores // streams)  # each call runs on its share of the cores
        options.inter_op_num_threads = 1
        options.graph_optimization_level = self.onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        return self.onnxruntime.InferenceSession(str(self.model_file), options, providers=["CPUExecutionProvider"])

    def configure_streams(self, spec: JobSpec) -> None:
        self.set_streams(cpu_streams(spec, "cpu", self.cores))

    def set_streams(self, streams: int) -> None:
        """Batches at once; the session's threads follow (a session's thread count is fixed when it is made)."""
        if streams != self.streams:
            self.streams = streams
            self.session = self._session(streams)

    def embed(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        input_ids, mask = padded_arrays(batch, self.pad_id)
        hidden = self.session.run(["last_hidden_state"], {"input_ids": input_ids, "attention_mask": mask})[0]
        return list(pool(hidden, mask, self.pooling))

    def generate(self, batch: Sequence[Sequence[int]], params: GenerationParams, overrides=None):
        raise ValueError("the onnxruntime engine embeds; generation runs on vllm or transformers")

    def close(self) -> None:
        self.session = None
