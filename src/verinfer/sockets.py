"""Listening sockets for the project's servers (``serve``, ``gateway``, ``dashboard``, tests): the
standard library only, so a server binds without importing the model stack."""

from __future__ import annotations

import socket


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (IPv4 or IPv6 by ``host``); OSError names the address when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def base_url(sock: socket.socket) -> str:
    """The OpenAI-style base URL (ending in ``/v1``) of a server listening on ``sock``."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
