"""The transformers engine: the model run with plain PyTorch, batches padded as we cut them.

It is the engine for machines where vLLM cannot run, and the honest baseline for the
benchmarks: each batch is padded to its longest row, so the padding our length buckets
avoid is padding this engine really computes.

- embed: AutoModel, then the model's own pooling and normalisation, read from its
  sentence-transformers config (modules.json, 1_Pooling/config.json), so vectors match
  sentence-transformers;
- generate: AutoModelForCausalLM.generate with left padding.

On a CPU in float32 every linear layer runs on oneDNN (torch's mkldnn_linear, see onednn_linears), not
torch's default MKL sgemm: on a 2-core AMD EPYC with AVX-512 (2026-11-28) MiniLM embedded at 13,500-15,700
tokens/s against 7,200-7,700, SmolLM2 decoded a step of 1 to 16 rows in 30-51 ms against 40-82, and the
outputs stayed within 1e-5 (greedy answers token for token the same). MKL's sgemm there also made a decode step
of 2 or 3 rows dearer than one of 4 to 8 (69 and 82 ms against 54-59: rows below 4 each read the weights
again), so a call's seconds were not a line in its rows (tokenmill.call_costs); on oneDNN they are.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from tokenmill.embedding import cpu_streams, read_pooling
from tokenmill.engine_protocol import Engine, Generation
from tokenmill.spec import CPU_TOKEN_BUDGET, GenerationParams, JobSpec, transformers_unsupported

log = logging.getLogger(__name__)

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16", "half": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, model_path: str, spec: JobSpec):
        started = time.perf_counter()
        import torch
        from transformers import AutoModel, AutoModelForCausalLM

        from tokenmill.models import load_tokenizer

        self.torch = torch
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = _torch_dtype(torch, spec.model.dtype, self.device)
        self.mode = spec.mode
        tokenizer = load_tokenizer(model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = _eos_ids(tokenizer, model_path)
        self.tokenizer = tokenizer
        loader = AutoModel if spec.mode == "embed" else AutoModelForCausalLM
        log.info("Starting transformers %s on %s in %s", model_path, self.device, self.dtype)
        self.model = loader.from_pretrained(model_path, dtype=self.dtype, **spec.model.engine_kwargs)
        self.model.to(self.device).eval()
        self.onednn_layers = onednn_linears(torch, self.model)  # float32 on a CPU only: 0 on a GPU or in bf16
        if self.onednn_layers:
            log.info("transformers: %d linear layers on oneDNN", self.onednn_layers)
        self.pooling = read_pooling(model_path) if spec.mode == "embed" else None
        self._torch_threads = _process_threads(torch)
        self.streams = 1
        self.configure_streams(spec)
        # the batch size a job leaves to the engine (tokenmill.engine_protocol.token_budget): embedding on a CPU, small
        # batches, two at once (see CPU_TOKEN_BUDGET); generation and GPUs keep the general default
        self.default_token_budget = CPU_TOKEN_BUDGET if self.device.type == "cpu" and spec.mode == "embed" else None
        self.start_seconds = time.perf_counter() - started

    def configure_streams(self, spec: JobSpec) -> None:
        """Run as many batches at once as the spec asks here (cpu_streams), each on its share of the
        cores: torch's thread count is per process, so it is set here and put back by close()."""
        self.set_streams(cpu_streams(spec, self.device.type, self._torch_threads))

    def set_streams(self, streams: int) -> None:
        changed, self.streams = streams != self.streams, streams
        self.torch.set_num_threads(max(1, self._torch_threads // streams))  # again: another engine may have moved it
        if changed:
            log.info("transformers on %s: %d batch(es) at once, %d torch threads each", self.device, streams,
                     self.torch.get_num_threads())

    def _padded(self, batch: Sequence[Sequence[int]], side: str):
        torch = self.torch
        longest = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, ids in enumerate(batch):
            if side == "right":
                input_ids[row, : len(ids)] = torch.as_tensor(ids)
                mask[row, : len(ids)] = 1
            else:
                input_ids[row, longest - len(ids):] = torch.as_tensor(ids)
                mask[row, longest - len(ids):] = 1
        return input_ids.to(self.device), mask.to(self.device)

    def embed(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        pooled = self._pooled(batch)  # the forward's activations are freed when _pooled returns
        # The vectors live until the shard is written: a copy holds the vectors alone. Without it, `cls`
        # pooling (a view, hidden[:, 0]) kept each batch's whole last hidden state (rows x tokens x dim).
        return list(pooled.cpu().numpy().copy())

    def _pooled(self, batch: Sequence[Sequence[int]]):
        torch = self.torch
        input_ids, mask = self._padded(batch, "right")
        with torch.inference_mode():
            hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            if self.pooling.mode == "cls":
                pooled = hidden[:, 0]
            elif self.pooling.mode == "max":
                pooled = hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
            elif self.pooling.mode == "lasttoken":
                pooled = hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
            else:
                pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
            pooled = pooled.float()
            if self.pooling.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled

    def generate(self, batch: Sequence[Sequence[int]], params: GenerationParams, overrides=None):
        """What Hugging Face `generate` has of vLLM's sampling: n (sampling only), stop strings and token
        ids, top_k, min_p, repetition_penalty, min_tokens, seed. The rest is refused when the job is
        validated (tokenmill.spec.transformers_unsupported); per-row overrides are vLLM's alone."""
        if overrides is not None and any(overrides):
            raise ValueError("the transformers engine takes the job's sampling parameters only, not per-row overrides")
        unsupported = transformers_unsupported(params)
        if unsupported:  # a spec built without validation (model_copy) must not get silently unconstrained output
            raise ValueError(f"the transformers engine does not support generation.{', generation.'.join(unsupported)}")
        torch = self.torch
        input_ids, mask = self._padded(batch, "left")
        sampling = params.temperature > 0
        if params.seed is not None:
            torch.manual_seed(params.seed)
        stop_ids = set(self.eos_ids) | set(params.stop_token_ids or [])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=params.max_tokens,
                min_new_tokens=params.min_tokens or None,
                do_sample=sampling,
                temperature=params.temperature if sampling else None,
                top_p=params.top_p if sampling else None,
                top_k=params.top_k if sampling and params.top_k else None,
                min_p=params.min_p if sampling and params.min_p else None,
                repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
                num_return_sequences=params.n,
                stop_strings=params.stop or None,
                tokenizer=self.tokenizer if params.stop else None,
                pad_token_id=self.pad_id,
                eos_token_id=sorted(stop_ids) or None,
            )
        completions = []
        for row in out[:, input_ids.shape[1]:].tolist():
            tokens = []
            finish = "length"
            for token in row:
                if token in stop_ids:
                    finish = "stop"
                    break
                tokens.append(token)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            for stop in params.stop or []:  # generate keeps the stop string; vLLM leaves it out
                if stop in text:
                    text, finish = text[: text.index(stop)], "stop"
            completions.append(Generation(text, len(tokens), finish))
        if params.n == 1:
            return completions
        rows = [completions[i: i + params.n] for i in range(0, len(completions), params.n)]
        return [Generation(c[0].text, sum(x.output_tokens for x in c), c[0].finish_reason, samples=tuple(c))
                for c in rows]

    def close(self) -> None:
        self.model = None
        self.set_streams(1)
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()


def onednn_linears(torch, model) -> int:
    """Every torch.nn.Linear of a float32 model on the CPU swapped for one that runs on oneDNN (see the module
    docstring), its weight held in oneDNN's layout; the number swapped: 0 where torch has no oneDNN here, or
    the model is not on the CPU. A weight the model ties to another (an LM head to its embeddings) is copied."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch._C._nn, "mkldnn_linear"):
        return 0
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and child.weight.device.type == "cpu"
               and child.weight.dtype == torch.float32]
    swap = _onednn_linear_class(torch)
    for parent, name, child in linears:
        setattr(parent, name, swap(child))
    return len(linears)


@functools.cache
def _onednn_linear_class(torch):
    class OneDnnLinear(torch.nn.Module):
        """A float32 torch.nn.Linear on oneDNN, for inference: any leading dimensions, dense in and out."""

        def __init__(self, linear):
            super().__init__()
            self.in_features, self.out_features = linear.in_features, linear.out_features
            # tensors, not parameters (inference only): what counts a model's weights counts these apart (bench/gpu.py)
            self.weight = linear.weight.detach().to_mkldnn()
            self.bias = linear.bias.detach().to_mkldnn() if linear.bias is not None else None

        def forward(self, x):
            rows = x.reshape(-1, self.in_features).contiguous().to_mkldnn()
            out = torch._C._nn.mkldnn_linear(rows, self.weight, self.bias).to_dense()
            return out.reshape(*x.shape[:-1], self.out_features)

    return OneDnnLinear


@functools.cache
def _process_threads(torch) -> int:
    """torch's threads for this process before any engine split them (another engine may have)."""
    return torch.get_num_threads()


def _torch_dtype(torch, dtype: str, device) -> "torch.dtype":
    if dtype == "auto":
        # fp32 on CPU (bf16 is several times slower there); bf16 on GPU, where tensor cores want it
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one the transformers engine knows ({', '.join(sorted(DTYPES))})")
    return getattr(torch, DTYPES[dtype])


def _eos_ids(tokenizer, model_path: str) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.exists():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else (value or []))
    return ids
