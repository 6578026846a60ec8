"""Binding a stdlib HTTP server without asking DNS for the host's name.

``http.server.HTTPServer.server_bind`` calls ``socket.getfqdn(host)``: a reverse DNS lookup
of the address it binds. Inside a node's network namespace no resolver is reachable, and
that lookup blocks for the resolver's full timeout, long enough for the agent's lease to
lapse and the node to be declared lost. The name is only used for CGI-style environ values,
so the address stands in for it.
"""

from __future__ import annotations

import socketserver
from http.server import HTTPServer


def bind_without_lookup(server: HTTPServer) -> None:
    """What ``HTTPServer.server_bind`` does, minus the DNS lookup; call it from ``server_bind``."""
    socketserver.TCPServer.server_bind(server)
    host, port = server.server_address[:2]
    server.server_name = str(host)
    server.server_port = int(port)
