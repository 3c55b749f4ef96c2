"""Object-store credentials from a Prefect block, kept out of specs, logs and run records.

A job may name `storage_block`: a Prefect Secret block whose value is a JSON object of
fsspec options (key, secret, token, endpoint_url, ...). Each task merges it into the
spec's storage_options in memory, at the moment it opens storage; the flow's parameters,
the task inputs, MLflow and the persisted results only ever hold the block's name.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import fsspec
from prefect.blocks.system import Secret
from prefect.filesystems import RemoteFileSystem
from pydantic import Field

from tokenmill.errors import ConfigError
from tokenmill.spec import JobSpec


def load_storage_secret(name: str) -> dict[str, Any]:
    try:
        value = Secret.load(name, _sync=True).get()  # _sync: also called from Prefect's event loop
    except ValueError as exc:
        raise ConfigError(f"storage_block {name!r}: no such Prefect Secret block ({exc})") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"storage_block {name!r} must hold a JSON object of fsspec options "
                          f"(key, secret, endpoint_url, ...), not a {type(value).__name__}")
    return value


def with_storage_secrets(spec: JobSpec) -> JobSpec:
    """The spec with its storage block's options merged in (the spec's own options win)."""
    block = getattr(spec, "storage_block", None)  # a PrefectJob's; a plain JobSpec has none
    if not block:
        return spec
    return spec.model_copy(update={"storage_options": {**load_storage_secret(block),
                                                       **spec.storage_options}})


class StateStorage(RemoteFileSystem):
    """Where shard results persist on an object store: a RemoteFileSystem whose credentials
    come from the job's storage block when the filesystem is opened, never from the saved block."""

    _block_type_name = "Tokenmill State Storage"
    _block_type_slug = "tokenmill-state-storage"

    storage_block: str | None = Field(None, description="Prefect Secret block with fsspec options")

    @property
    def filesystem(self) -> fsspec.AbstractFileSystem:
        if not self._filesystem:
            settings = dict(self.settings)
            if self.storage_block:
                settings = {**load_storage_secret(self.storage_block), **settings}
            scheme = urllib.parse.urlsplit(self.basepath).scheme
            self._filesystem = fsspec.filesystem(scheme, **settings)
        return self._filesystem
