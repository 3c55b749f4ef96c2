"""The openai-server engine: a shard's rows sent as concurrent requests to an OpenAI-compatible server that
someone else runs (`vllm serve`, SGLang), sharing it with live traffic.

The runner tokenizes as for any engine (model.name's tokenizer: chat templates applied here) and hands over
token ids: generation goes to /v1/completions with the ids as the prompt (a chat job's rows are already
rendered with the model's chat template, so this is what /v1/chat/completions would run), embeddings to
/v1/embeddings. Requests go out through the `openai` package's AsyncOpenAI on an event loop of the engine's
own, at most `limit` in flight: the cap from the live SLO (tokenmill.server_control.cap_from_slo, from a short
probe of o and c), lowered and raised by the AIMD window as live load on the server rises and falls
(its /metrics, read every metrics_poll_seconds). A request cut off when the window shrinks goes back to the
front of the queue; each row's slot is filled exactly once.

Before any shard: the server must answer, take the key, and serve the model (/v1/models), or the job stops
with one line naming the URL or the model (ServerError). 429, 503, timeouts and refused connections are
retried with backoff, each logged; past max_retries the shard fails and the job stops, finished shards kept.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np

from tokenmill.engine_protocol import Engine, Generation
from tokenmill.errors import ConfigError
from tokenmill.generation import sampling_kwargs
from tokenmill.server_control import Aimd, CallCost, cap_from_slo, fit_call_cost, parse_load, recent_ttft
from tokenmill.server_spec import ServerSpec, stop_by_deadline
from tokenmill.spec import GenerationParams, JobSpec

log = logging.getLogger(__name__)

PROBE_SIZES = (1, 2, 4, 8, 16)  # items at once in the probe's rounds: o and c are fitted over them
PROBE_REPEATS = 2
PROBE_TOKENS = 16  # tokens a generation probe's long requests ask for: the decode steps it times
RETRY_STATUSES = frozenset({429, 502, 503, 504})
FIRST_BACKOFF_S = 0.5
# the OpenAI completions fields a SamplingParams keyword goes under as is; the rest go in extra_body (vLLM's)
OPENAI_FIELDS = ("n", "max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty")


class ServerError(ConfigError):
    """The server cannot run the job: unreachable, refusing the key, not serving the model."""


class StopByReached(Exception):
    """stop_by came: in-flight requests drained, nothing new sent. The shard is left for the next run."""


def api_key(server: ServerSpec) -> str | None:
    """The key, from the variable server.api_key_env names (None: no key)."""
    if not server.api_key_env:
        return None
    key = os.environ.get(server.api_key_env)
    if not key:
        raise ServerError(f"{server.url}: server.api_key_env names {server.api_key_env}, which is not set")
    return key


def metrics_url(base_url: str) -> str:
    return base_url.removesuffix("/v1") + "/metrics"


class ServerEngine(Engine):
    name = "openai-server"

    def __init__(self, model_path: str, spec: JobSpec):
        started = time.perf_counter()
        if spec.server is None:
            raise ConfigError("model.engine openai-server needs a server section (server.url, ...)")
        self.server: ServerSpec = spec.server
        self.url = self.server.url
        self.model = self.server.model or spec.model_name
        self.mode = spec.mode
        self.ceiling = self.server.max_in_flight or spec.batching.max_batch_size
        self.stats = ServerStats()
        self.aimd: Aimd | None = None
        self.cost: CallCost | None = None
        self.deadline = stop_by_deadline(getattr(spec, "stop_by", None))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tokenmill-server", daemon=True)
        self._thread.start()
        self._in_flight = 0
        self._poller: asyncio.Future | None = None
        try:
            self._call(self._open(api_key(self.server)))
            self.scheduling = self._call(self._scheduling())
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - started
        log.info("openai-server %s, model %s: scheduling %s", self.url, self.model, self.scheduling)

    # ---- the protocol -------------------------------------------------------------------------------

    def embed(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        payloads = [{"input": list(ids)} for ids in batch]
        return self._call(self._run(payloads, self._embed_one))

    def generate(self, batch: Sequence[Sequence[int]], params: GenerationParams,
                 overrides: Sequence[Mapping[str, Any] | None] | None = None) -> list[Generation]:
        rows = overrides if overrides is not None else [None] * len(batch)
        payloads = [completion_body(ids, sampling_kwargs(params, row)) for ids, row in zip(batch, rows)]
        return self._call(self._run(payloads, self._complete_one))

    def close(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is None or loop.is_closed():
            return
        try:
            if loop.is_running():
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
                loop.call_soon_threadsafe(loop.stop)
                self._thread.join(timeout=10)
        finally:
            if not loop.is_running():
                loop.close()

    def begin_job(self) -> None:
        """A new job on this engine (an engine outlives a job in a long-lived process): its figures from zero."""
        self.stats = ServerStats()
        if self.aimd is not None:
            self.aimd.yielded_s, self.aimd.decreases = 0.0, 0

    def figures(self) -> tuple[dict[str, str], dict[str, float]]:
        """(params, metrics) for the run record: the server, the mode that ran, the cap and its inputs, the
        time yielded, retries and requests cut off. Never the key."""
        params = {"server_url": self.url, "server_model": self.model, "server_scheduling": self.scheduling,
                  "server_slo_ms": str(self.server.slo_ms), "server_share": str(self.server.share)}
        metrics = {"server_cap": float(self.aimd.cap if self.aimd else self.ceiling),
                   "server_seconds_yielded": self.aimd.yielded_s if self.aimd else 0.0,
                   "server_window_decreases": float(self.aimd.decreases if self.aimd else 0),
                   "server_retries": float(self.stats.retries), "server_requests_cut_off": float(self.stats.cut_off),
                   "server_requests": float(self.stats.requests), "server_busy_seconds": self.stats.busy_s,
                   "server_requests_with_priority": float(self.stats.with_priority),
                   "server_peak_in_flight": float(self.stats.peak_in_flight)}
        if self.cost is not None:
            metrics["server_overhead_ms"] = self.cost.overhead_s * 1000
            metrics["server_item_ms"] = self.cost.per_item_s * 1000
        return params, metrics

    # ---- the loop -----------------------------------------------------------------------------------

    def _call(self, coroutine):
        """Run a coroutine on the engine's loop and wait for it (from the runner's thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _open(self, key: str | None) -> None:
        import httpx
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(base_url=self.url, api_key=key or "none", max_retries=0,
                                  timeout=self.server.timeout_seconds)
        self.http = httpx.AsyncClient(timeout=10.0, headers={"Authorization": f"Bearer {key}"} if key else {})
        await self._preflight()

    async def _preflight(self) -> None:
        """The server answers, takes the key, and serves the model: else one line naming the URL or the model."""
        import openai

        try:
            served = [m.id async for m in self.client.models.list()]
        except openai.AuthenticationError as exc:
            raise ServerError(f"{self.url}: the server refused the API key ({exc.status_code}); check "
                              f"{self.server.api_key_env or 'server.api_key_env'}") from None
        except openai.APIConnectionError as exc:
            raise ServerError(f"{self.url}: no server answers ({_cause(exc)})") from None
        except openai.APIStatusError as exc:
            raise ServerError(f"{self.url}/models answered HTTP {exc.status_code}: not an OpenAI-compatible "
                              "API at this URL?") from None
        if self.model not in served:
            raise ServerError(f"{self.url} does not serve model {self.model!r}; it serves: "
                              f"{', '.join(served) or 'nothing'} (set server.model)")

    async def _scheduling(self) -> str:
        """Which priority mode runs: 'priority' (the server schedules by priority: the batch's is sent),
        'fcfs' (it does not: nothing sent), 'sent-unverified' (the server's policy is unreadable and it
        took a request with a priority), 'off' (the job said so)."""
        choice = self.server.priority
        if choice == "off":
            return "off"
        if choice == "on":
            return "priority"
        try:
            answer = await self.http.get(self.url.removesuffix("/v1") + "/server_info",
                                         params={"config_format": "json"})
            if answer.status_code == 200:
                policy = answer.json().get("vllm_config", {}).get("scheduler_config", {}).get("policy")
                if policy in ("priority", "fcfs"):
                    return policy
        except Exception as exc:  # noqa: BLE001 - not vLLM's dev API: try a request instead
            log.debug("no /server_info at %s: %s", self.url, exc)
        return "sent-unverified" if await self._priority_accepted() else "fcfs"

    async def _priority_accepted(self) -> bool:
        import openai

        try:
            body = {"input": [0]} if self.mode == "embed" else completion_body([0], {"max_tokens": 1})
            body["extra_body"] = {**body.get("extra_body", {}), "priority": self.server.priority_value}
            await (self.client.embeddings.create(model=self.model, **body) if self.mode == "embed"
                   else self.client.completions.create(model=self.model, **body))
            return True
        except openai.BadRequestError as exc:
            if "priority" in str(exc).lower():
                return False
            raise ServerError(f"{self.url}: a one-token request to {self.model!r} failed: {exc}") from None

    # ---- requests -----------------------------------------------------------------------------------

    def _extra(self, extra: dict[str, Any]) -> dict[str, Any]:
        if self.scheduling in ("priority", "sent-unverified"):
            self.stats.with_priority += 1
            return {**extra, "priority": self.server.priority_value}
        return extra

    async def _embed_one(self, payload: dict[str, Any]) -> np.ndarray:
        answer = await self._with_retries(lambda: self.client.embeddings.create(
            model=self.model, input=payload["input"], encoding_format="float", extra_body=self._extra({})))
        self.stats.tokens += int(getattr(answer.usage, "prompt_tokens", 0) or 0) if answer.usage else 0
        return np.asarray(answer.data[0].embedding, dtype=np.float32)

    async def _complete_one(self, payload: dict[str, Any]) -> Generation:
        body = dict(payload)
        body["extra_body"] = self._extra(body.get("extra_body", {}))
        answer = await self._with_retries(lambda: self.client.completions.create(model=self.model, **body))
        if answer.usage is not None:
            self.stats.tokens += int(answer.usage.prompt_tokens) + int(answer.usage.completion_tokens)
        return completion_generation(answer)

    async def _with_retries(self, send: Callable[[], Any]):
        """One request, again on 429/5xx-busy, a timeout or a refused connection: backoff doubling from
        FIRST_BACKOFF_S, each retry logged; past max_retries the error goes up (the shard fails)."""
        import openai

        for attempt in range(self.server.max_retries + 1):
            self._in_flight += 1
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, self._in_flight)
            started = time.perf_counter()
            try:
                answer = await send()
                self.stats.requests += 1
                self.stats.latencies.append(time.perf_counter() - started)
                return answer
            except (openai.APIConnectionError, openai.APIStatusError) as exc:
                status = getattr(exc, "status_code", None)
                retryable = status is None or status in RETRY_STATUSES
                if not retryable or attempt == self.server.max_retries:
                    raise ServerError(f"{self.url}: {_describe(exc)}" + (
                        f" after {attempt} retries" if attempt else "")) from None
                wait = FIRST_BACKOFF_S * 2 ** attempt
                self.stats.retries += 1
                log.warning("%s: %s; retry %d of %d in %.1f s", self.url, _describe(exc), attempt + 1,
                            self.server.max_retries, wait)
            finally:
                self._in_flight -= 1
            await asyncio.sleep(wait)

    async def _run(self, payloads: list[dict[str, Any]], send_one) -> list:
        """Every payload sent, at most the window in flight; results in the payloads' order."""
        if self.aimd is None:
            await self._start_sharing(payloads, send_one)
        started = time.perf_counter()
        try:
            return await self._dispatch(payloads, send_one)
        finally:
            self.stats.busy_s += time.perf_counter() - started

    async def _dispatch(self, payloads: list[dict[str, Any]], send_one) -> list:
        results: list = [None] * len(payloads)
        filled = [False] * len(payloads)
        queue = deque(range(len(payloads)))
        running: dict[asyncio.Task, int] = {}
        try:
            while queue or running:
                if self._past_admission():
                    queue.clear()  # nothing new: drain what is in flight, then stop
                while queue and len(running) < self.aimd.limit:
                    index = queue.popleft()
                    running[asyncio.ensure_future(send_one(payloads[index]))] = index
                self._cut_off(running)
                if not running:
                    if self.deadline_passed():
                        raise StopByReached(f"stop_by {self.deadline:%Y-%m-%d %H:%M:%S %Z} reached")
                    await asyncio.sleep(min(0.2, self.server.metrics_poll_seconds))  # window 0: yielding
                    continue
                done, _ = await asyncio.wait(running, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = running.pop(task)
                    if task.cancelled():
                        queue.appendleft(index)  # cut off: sent again, its slot still empty
                        continue
                    results[index] = task.result()  # a failed request fails the call here
                    filled[index] = True
            if not all(filled):
                raise StopByReached(f"stop_by {self.deadline:%Y-%m-%d %H:%M:%S %Z} reached: "
                                    f"{filled.count(False)} rows not sent")
            return results
        finally:
            for task in running:
                task.cancel()

    def _cut_off(self, running: dict[asyncio.Task, int]) -> None:
        """Requests over a window that shrank: the newest are cancelled (the server aborts them) and sent again."""
        excess = len(running) - self.aimd.limit
        live = [task for task in running if not task.done()]
        for task in live[len(live) - excess:] if excess > 0 else []:
            task.cancel()
            self.stats.cut_off += 1

    def _past_admission(self) -> bool:
        """Whether a request sent now would not finish before stop_by (its p90 latency so far)."""
        if self.deadline is None:
            return False
        return time.time() + self.stats.p90_latency() >= self.deadline.timestamp()

    def deadline_passed(self) -> bool:
        return self.deadline is not None and datetime.now(timezone.utc) >= self.deadline

    # ---- sharing: the cap and the window -------------------------------------------------------------

    async def _start_sharing(self, payloads: list[dict[str, Any]], send_one) -> None:
        """The cap (probed on the first rows of the job) and the AIMD window, and the /metrics poll."""
        budget_s = self.server.share * self.server.slo_ms / 1000.0
        cap = self.ceiling
        if self.server.probe and payloads:
            self.cost = await self._probe(payloads, send_one)
            cap = cap_from_slo(self.cost, self.server.slo_ms, self.server.share, self.ceiling)
            if self.cost.overhead_s + self.cost.per_item_s > budget_s:
                log.warning("%s: one item costs %.0f ms, over share x SLO = %.0f ms: the batch sends one at a time",
                            self.url, (self.cost.overhead_s + self.cost.per_item_s) * 1000, budget_s * 1000)
            log.info("%s: o = %.1f ms, c = %.1f ms per item; in-flight cap %d (share %.2f x SLO %.0f ms)",
                     self.url, self.cost.overhead_s * 1000, self.cost.per_item_s * 1000, cap, self.server.share,
                     self.server.slo_ms)
        self.aimd = Aimd(cap=cap, slo_s=self.server.slo_ms / 1000.0, share=self.server.share)
        self.stats.peak_in_flight = 0  # the probe's rounds go up to 8 at once: the cap counts from here
        if self.server.adapt:
            self._poller = asyncio.ensure_future(self._poll_metrics())

    async def _probe(self, payloads: list[dict[str, Any]], send_one) -> CallCost:
        """Step time against items in flight, over rounds of 1, 2, 4, 8, 16 concurrent requests (the job's
        first rows; no size past the budget), o and c fitted over them.

        What a live request arriving behind the batch waits for is one server step, not a whole request.
        An embedding request is one step: its round's time. A generation request is a prefill step and
        then one decode step per token, every sequence in flight in each: a round of PROBE_TOKENS-token
        requests less a round of one-token requests (same rows, same size), over the tokens between, is
        the time of one decode step at that size (HTTP, tokenizing and prefill cancel out)."""
        rows = payloads[: max(PROBE_SIZES)]
        points: list[tuple[int, float]] = []
        budget_s = self.server.share * self.server.slo_ms / 1000.0
        for size in PROBE_SIZES:
            if len(points) >= 2 and (size > len(rows) or points[-1][1] > budget_s):
                break
            chosen = [rows[i % len(rows)] for i in range(size)]
            one, _ = await self._fastest_round([_tokens(p, 1) for p in chosen], send_one)
            if self.mode == "embed":
                points.append((size, one))
                continue
            many, produced = await self._fastest_round([_tokens(p, PROBE_TOKENS) for p in chosen], send_one)
            points.append((size, max(many - one, 0.0) / max(produced - 1, 1)))
        return fit_call_cost(points)

    async def _fastest_round(self, chosen: list[dict[str, Any]], send_one) -> tuple[float, int]:
        """The faster of PROBE_REPEATS rounds of the requests at once (a busy server's noise only adds time),
        with the most tokens any of its requests generated."""
        best, produced = float("inf"), 1
        for _ in range(PROBE_REPEATS):
            started = time.perf_counter()
            answers = await asyncio.gather(*(send_one(p) for p in chosen))
            elapsed = time.perf_counter() - started
            if elapsed < best:
                best = elapsed
                produced = max((a.output_tokens for a in answers if isinstance(a, Generation)), default=1)
        return best, produced

    async def _poll_metrics(self) -> None:
        before, last = None, time.perf_counter()
        while True:
            await asyncio.sleep(self.server.metrics_poll_seconds)
            try:
                answer = await self.http.get(metrics_url(self.url))
                load = parse_load(answer.text)
            except Exception as exc:  # noqa: BLE001 - a missed read holds the window where it is
                log.debug("reading %s failed: %s", metrics_url(self.url), exc)
                continue
            now = time.perf_counter()
            limit_before = self.aimd.limit
            self.aimd.update(load, self._in_flight, recent_ttft(before, load), now - last)
            if self.aimd.limit < limit_before:
                log.info("%s: live load (%d waiting, %d running): in flight %d -> %d", self.url, load.waiting,
                         load.running, limit_before, self.aimd.limit)
            before, last = load, now

    async def _shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for name in ("client", "http"):
            closer = getattr(self, name, None)
            if closer is not None:
                await (closer.close() if name == "client" else closer.aclose())


class ServerStats:
    """What the engine counted: requests answered, retries, requests cut off, seconds with work in flight."""

    def __init__(self) -> None:
        self.requests = 0
        self.retries = 0
        self.cut_off = 0
        self.with_priority = 0  # requests sent with the batch's priority
        self.peak_in_flight = 0  # after the probe: the most requests in flight at once
        self.busy_s = 0.0
        self.tokens = 0  # prompt and completion tokens the server reported (the probe's too)
        self.latencies: deque[float] = deque(maxlen=512)

    def p90_latency(self) -> float:
        if not self.latencies:
            return 0.0
        ordered = sorted(self.latencies)
        return ordered[int(0.9 * (len(ordered) - 1))]


def completion_body(ids: Sequence[int], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """/v1/completions arguments for a row's token ids under SamplingParams keywords: OpenAI's own fields as
    they are, vLLM's (top_k, min_p, structured outputs, ...) in extra_body; logprobs as token ids."""
    body: dict[str, Any] = {"prompt": list(ids)}
    extra: dict[str, Any] = {}
    for name, value in kwargs.items():
        if value is None:
            continue
        if name in OPENAI_FIELDS:
            body[name] = value
        elif name == "logprobs":
            body["logprobs"] = value
            extra["return_tokens_as_token_ids"] = True
        else:
            extra[name] = value
    if extra:
        body["extra_body"] = extra
    return body


def completion_generation(answer) -> Generation:
    """A /v1/completions answer (one prompt, n choices) as our Generation."""
    choices = sorted(answer.choices, key=lambda c: c.index)
    usage = answer.usage
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    cached = int(getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
    total = int(usage.completion_tokens) if usage is not None else 0
    completions = [Generation(c.text, 0, c.finish_reason, _logprobs(c.logprobs)) for c in choices]
    if len(completions) == 1:
        first = completions[0]
        return Generation(first.text, total, first.finish_reason, first.logprobs, (), cached)
    first = completions[0]
    return Generation(first.text, total, first.finish_reason, first.logprobs, tuple(completions), cached)


def _logprobs(logprobs) -> list[dict] | None:
    """OpenAI's completions logprobs (tokens as 'token_id:N') in our per-token shape."""
    if logprobs is None or logprobs.tokens is None:
        return None
    entries = []
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs or []):
        entries.append({"token_id": _token_id(token), "token": token, "logprob": logprob,
                        "top_logprobs": [{"token_id": _token_id(t), "token": t, "logprob": lp}
                                         for t, lp in sorted((top or {}).items(), key=lambda kv: -kv[1])]})
    return entries


def _token_id(token: str) -> int | None:
    return int(token.split(":", 1)[1]) if token.startswith("token_id:") else None


def _tokens(payload: dict[str, Any], count: int) -> dict[str, Any]:
    """A probe's copy of a row's request: `count` tokens, one completion (an embedding request as it is)."""
    if "prompt" not in payload:
        return payload
    extra = {k: v for k, v in payload.get("extra_body", {}).items() if k != "min_tokens"}
    return {**payload, "max_tokens": count, "n": 1, **({"extra_body": extra} if extra else {})}


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status_code", None)
    return f"HTTP {status}" if status is not None else f"connection failed ({_cause(exc)})"
