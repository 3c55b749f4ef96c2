"""The OpenVINO engine: embedding models in float32 (the ONNX export) or int8 (NNCF, calibrated on the job's rows).

The second int8 runtime of the cheap tier on CPU, beside ONNX Runtime (tokenmill.onnx_engine). Its int8
is static: activation scales are fixed by a calibration sample of the job's own rows, so attention's
products run in int8 too, where ONNX Runtime's dynamic int8 keeps them in float32. A job never runs it
unless it asks to or the eval gate passed it (tokenmill.gate): `engine: auto` never swaps precision.

Batches are padded as the runner cuts them (length buckets) and pooled as sentence-transformers would
(tokenmill.embedding). One batch at a time on all the cores (see openvino_models.COMPILE_CONFIG).
Embedding only.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Sequence

import numpy as np

from tokenmill.bucketing import plan_batches
from tokenmill.digest import stable_digest
from tokenmill.embedding import padded_arrays, pool, read_pooling, usable_cores
from tokenmill.encoding import encode_rows
from tokenmill.engine_protocol import Engine
from tokenmill.openvino_models import compile_config, openvino_model
from tokenmill.sampling import corpus_sample
from tokenmill.spec import CPU_TOKEN_BUDGET, GenerationParams, JobSpec

log = logging.getLogger(__name__)

# The calibration sample: rows of the job's corpus, chosen by id hash with a seed of its own (the gate's
# sample uses gate.sample_seed, 0 by default: the calibration rows are not the rows the gate judges), up to
# CALIBRATION_ROWS rows and CALIBRATION_TOKENS tokens, never fewer than MIN_CALIBRATION_ROWS. NNCF runs the
# float32 model over them twice (SmoothQuant's statistics, then the ranges), so their tokens are the first
# run's cost, beside NNCF's graph analysis and compiles (~8 s, fixed). Measured on a 2-core machine other
# work loaded (load 3 to 9, so seconds swung 2x): 256 long rows (~65k tokens) 30-44 s, 64 (~16k) 16-26 s. Quality on the gate's sample, against
# float32 (cosine_mean / top-10; bench corpora): long 256 rows 0.9958 / 0.938, 64 rows 0.9970 / 0.943,
# 32 rows 0.9966 / 0.942; mixed 256 rows 0.9973 / 0.944, 64 rows 0.9962 / 0.937; short 256 rows
# 0.9973 / 0.951, 64 rows 0.9968 / 0.946, 32 rows 0.9948 / 0.931. Without SmoothQuant, long fell to
# 0.982 / 0.874 (it fails the gate): both passes stay.
CALIBRATION_ROWS = 256
CALIBRATION_TOKENS = 16_384
MIN_CALIBRATION_ROWS = 64
CALIBRATION_SEED = 29


class OpenVinoEngine(Engine):
    name = "openvino"

    def __init__(self, model_path: str, spec: JobSpec):
        if spec.mode != "embed":
            raise ValueError("the openvino engine embeds; generation runs on vllm or transformers")
        started = time.perf_counter()
        import openvino

        from tokenmill.models import load_text_tokenizer

        tokenizer = load_text_tokenizer(model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.pooling = read_pooling(model_path)
        self.quantization = spec.model.quantization
        self.cores = usable_cores()
        batches, digest = calibration(spec, model_path) if self.quantization else ((), "")
        self.model_file = openvino_model(model_path, self.quantization, spec.model_name, batches, digest)
        self.compiled = openvino.Core().compile_model(str(self.model_file), "CPU", compile_config(self.cores))
        self.request = self.compiled.create_infer_request()
        self.output = self.compiled.output(0)
        self.default_token_budget = CPU_TOKEN_BUDGET
        self.start_seconds = time.perf_counter() - started
        log.info("Started openvino %s (%s) in %.1f s", self.model_file, self.quantization or "float32",
                 self.start_seconds)

    def embed(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        input_ids, mask = padded_arrays(batch, self.pad_id)
        hidden = self.request.infer({"input_ids": input_ids, "attention_mask": mask})[self.output]
        return list(pool(hidden, mask, self.pooling))

    def generate(self, batch: Sequence[Sequence[int]], params: GenerationParams, overrides=None):
        raise ValueError("the openvino engine embeds; generation runs on vllm or transformers")

    def close(self) -> None:
        self.request = self.compiled = None


def calibration_rows(token_ids: list[list[int]]) -> list[list[int]]:
    """The sample's rows, in its (id-hash) order, until CALIBRATION_TOKENS tokens: long rows calibrate on
    fewer of them (never fewer than MIN_CALIBRATION_ROWS), short ones on all CALIBRATION_ROWS."""
    kept, tokens = [], 0
    for ids in token_ids:
        if len(kept) >= MIN_CALIBRATION_ROWS and tokens + len(ids) > CALIBRATION_TOKENS:
            break
        kept.append(ids)
        tokens += len(ids)
    return kept


def calibration(spec: JobSpec, model_path: str) -> tuple[list[dict[str, np.ndarray]], str]:
    """The int8 model's calibration inputs: CALIBRATION_ROWS rows of the job's corpus, tokenized as the job
    tokenizes them and cut into padded batches as the engine is fed them; and a digest of their token ids."""
    fields = spec.model_dump_json(include={"input", "format", "id_column", "text_column", "storage_options",
                                           "overlong", "batching", "mode"})
    return _calibration(fields, spec.model.model_dump_json(), model_path)


@functools.lru_cache(maxsize=4)
def _calibration(fields: str, model: str, model_path: str) -> tuple[list[dict[str, np.ndarray]], str]:
    import json

    from tokenmill.models import load_text_tokenizer

    spec = JobSpec.model_validate({**json.loads(fields), "model": json.loads(model)})
    texts, _ = corpus_sample(spec, CALIBRATION_ROWS, CALIBRATION_SEED)
    encoded = encode_rows(texts, spec, model_path)
    refused = {i for i, _ in encoded.overlong}
    token_ids = calibration_rows([ids for i, ids in enumerate(encoded.token_ids) if i not in refused])
    pad_id = load_text_tokenizer(model_path).pad_token_id or 0
    batches = plan_batches([len(ids) for ids in token_ids], spec.batching.token_budget or CPU_TOKEN_BUDGET,
                           spec.batching.max_batch_size, spec.batching.length_tolerance)
    arrays = [padded_arrays([token_ids[i] for i in batch], pad_id) for batch in batches]
    inputs = [{"input_ids": ids, "attention_mask": mask} for ids, mask in arrays]
    return inputs, stable_digest(token_ids, 16)
