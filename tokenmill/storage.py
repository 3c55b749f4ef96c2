"""Filesystems and retries for input and output I/O, local or on object stores.

Object stores fail in passing: S3 answers 503 SlowDown under load, 500 InternalError
now and then, and connections reset. Those calls are retried here, with exponential
backoff and jitter, and every retry is logged with its cause. s3fs and botocore would
otherwise retry the same errors silently (up to 25 attempts per call, none of them
in any log), so their own retries are turned off for the filesystems we open, unless
the job's storage_options set them.

Data errors (a corrupt file, a missing column) and access errors (no such key,
access denied) are never retried: the same call would fail the same way.
"""

from __future__ import annotations

import errno
import logging
import random
import re
import time
from typing import Any, Callable, TypeVar

import fsspec

from tokenmill.errors import TokenmillError

log = logging.getLogger(__name__)

T = TypeVar("T")
_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^\s\"'<>]+", re.IGNORECASE)

IO_ATTEMPTS = 6
IO_BASE_SECONDS = 0.5
IO_MAX_SECONDS = 30.0
IO_JITTER = 0.5  # each wait is scaled by a random factor in [1 - jitter, 1 + jitter]

# errno values s3fs and the OS use for passing trouble: busy/slow down (503), remote I/O (500),
# generic I/O, and the network ones.
TRANSIENT_ERRNOS = {
    errno.EIO, errno.EBUSY, errno.EAGAIN, errno.EREMOTEIO, errno.ETIMEDOUT, errno.ECONNRESET,
    errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE, errno.ENETUNREACH, errno.EHOSTUNREACH,
}
THROTTLING_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                    "ServiceUnavailable", "InternalError", "RequestTimeout"}
NETWORK_ERROR_NAMES = {
    # botocore
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "HTTPClientError", "IncompleteReadError", "ResponseStreamingError", "ProxyConnectionError",
    # aiohttp
    "ServerDisconnectedError", "ClientConnectionError", "ClientOSError", "ClientPayloadError",
    "ServerTimeoutError", "ClientConnectorError",
}


def is_transient(exc: BaseException) -> bool:
    """Whether the same call may well succeed if made again in a moment."""
    if isinstance(exc, TokenmillError):
        return False
    if _is_arrow_error(exc):
        return False  # pyarrow raises OSError for corrupt data too
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if type(exc).__name__ in NETWORK_ERROR_NAMES:
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or status == 429 or response.get("Error", {}).get("Code") in THROTTLING_CODES
    if isinstance(exc, OSError):
        return exc.errno in TRANSIENT_ERRNOS
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)


def describe_error(exc: BaseException) -> str:
    """The error's type and first line, for a log, with any endpoint URL taken out (an
    object store's endpoint is configuration we keep out of logs, like its credentials)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = _URL.sub("<endpoint>", text)
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


def retry_io(call: Callable[[], T], what: str, *, attempts: int = IO_ATTEMPTS,
             base_seconds: float = IO_BASE_SECONDS, max_seconds: float = IO_MAX_SECONDS) -> T:
    """call(), retried on transient errors with exponential backoff and jitter; each retry logged."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as exc:
            if attempt == attempts or not is_transient(exc):
                raise
            wait = min(max_seconds, base_seconds * 2 ** (attempt - 1))
            wait *= random.uniform(1 - IO_JITTER, 1 + IO_JITTER)
            log.warning("%s failed (%s); retry %d/%d in %.1f s", what, describe_error(exc), attempt,
                        attempts - 1, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def url_to_fs(uri: str, storage_options: dict[str, Any] | None = None):
    """(filesystem, path) for a URI, with the store's own silent retries off (see module doc)."""
    options = dict(storage_options or {})
    protocol = uri.split("://", 1)[0] if "://" in uri else "file"
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        silent_retries_off = "retries" not in config
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        options["config_kwargs"] = config
        fs, path = fsspec.core.url_to_fs(uri, **options)
        if silent_retries_off:
            fs.retries = 1  # s3fs's own retry loop (a class attribute; this instance is ours)
        return fs, path
    return fsspec.core.url_to_fs(uri, **options)


def _is_arrow_error(exc: BaseException) -> bool:
    try:
        import pyarrow as pa
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, pa.ArrowException)
