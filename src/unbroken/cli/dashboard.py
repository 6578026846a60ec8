"""``unbroken dashboard``: serve the web dashboard of a cluster."""

from __future__ import annotations

import ipaddress
import secrets
import socket
from pathlib import Path

from unbroken.cli.common import console, open_runtime
from unbroken.errors import UsageError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_dashboard(directory: Path | None, host: str, port: int, token: str | None) -> None:
    import uvicorn

    from unbroken.dashboard.app import create_app

    runtime = open_runtime(directory)
    if token is not None and len(token) < 16:
        raise UsageError(f"--token is {len(token)} characters; give at least 16 (or none on a network address: one is made for you)")
    if not is_loopback(host) and token is None:
        token = secrets.token_urlsafe(24)  # bound to the network: never open without one
    # Listen first, so the printed URL has the real port (also for --port 0) and works at once.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)  # connections queue from now on, while uvicorn starts
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{sock.getsockname()[1]}/" + (f"?token={token}" if token else "")
    console.print(f"dashboard of {runtime.layout.root}: [bold]{url}[/]", highlight=False, soft_wrap=True)
    config = uvicorn.Config(create_app(runtime, token=token), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
