"""Prefect's ephemeral API server, as Prefect starts it, telling its command when each step of its start ended.

Prefect runs `uvicorn --factory prefect.server.api.server:create_app --lifespan on` (its SubprocessASGIServer);
this script runs the same app the same way, and writes to the pipe whose descriptor MARKS_VARIABLE names the
wall-clock moments (time.time(), as tokenmill.timeline keeps them) its startup began and ended (a pipe, not a
file: nothing is left behind when either process is killed).
The startup is where the server creates its database the first time on a machine (Prefect's migrations, its
block types registered): seconds a first run pays once, which the command that spawned it measures apart
(tasks/warm.py) so a later run's start is predicted from the parts a first one measured.

Run as `python -P <this file> --port N` (-P: this folder's modules do not shadow top-level ones); importing
it imports nothing but the standard library.
"""

from __future__ import annotations

import os
import sys
import time

MARKS_VARIABLE = "TOKENMILL_API_MARKS"
STARTUP_BEGUN, STARTUP_DONE = "api_startup_start", "api_startup_done"


def mark(name: str) -> None:
    descriptor = os.environ.get(MARKS_VARIABLE)
    if descriptor:
        try:
            os.write(int(descriptor), f"{name} {time.time():.6f}\n".encode())  # one write: whole, under PIPE_BUF
        except (OSError, ValueError):  # the command stopped reading: the server serves on
            pass


def read_marks(descriptor: int) -> dict[str, float]:
    """The marks a server wrote to the pipe's reading end so far (the first of each name), without waiting."""
    os.set_blocking(descriptor, False)
    data = b""
    while True:
        try:
            chunk = os.read(descriptor, 4096)
        except BlockingIOError:
            break
        if not chunk:  # the server closed it (it exited)
            break
        data += chunk
    found: dict[str, float] = {}
    for line in data.decode(errors="replace").splitlines():
        name, _, when = line.partition(" ")
        try:
            found.setdefault(name, float(when))
        except ValueError:
            continue
    return found


def timed_app():
    """Prefect's app, its lifespan's startup marked (uvicorn calls this as the factory Prefect names)."""
    from prefect.server.api.server import create_app

    app = create_app()

    async def timed(scope, receive, send):
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)

        async def received():
            message = await receive()
            if message["type"] == "lifespan.startup":
                mark(STARTUP_BEGUN)
            return message

        async def sent(message):
            if message["type"] == "lifespan.startup.complete":
                mark(STARTUP_DONE)
            await send(message)

        return await app(scope, received, sent)

    return timed


def main(argv: list[str]) -> None:
    import uvicorn

    port = int(argv[argv.index("--port") + 1])
    # sys.exit(3) where the port was taken after the command chose it, as `uvicorn` does (tasks/warm.py)
    uvicorn.run(timed_app, factory=True, host="127.0.0.1", port=port, log_level="error", lifespan="on")


if __name__ == "__main__":
    main(sys.argv[1:])
