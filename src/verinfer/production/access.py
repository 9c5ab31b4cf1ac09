"""Who may read a service's own pages: the rule the dashboard and the gateway share.

A service binds loopback unless told otherwise; beyond loopback it refuses to start without a token
(``--auth-token-env NAME``: a variable holding at least 16 characters). With a token its routes ask
for it as ``Authorization: Bearer TOKEN`` (Prometheus' ``authorization`` setting) or as the password
of HTTP basic auth (what a browser prompts for); a health route answers its status to anyone, its
details only with the token. Standard library only: the gateway imports it without the dashboard's stack.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import secrets

MIN_TOKEN_CHARS = 16


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and ``localhost``: addresses only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def authorized(header: str | None, token: str) -> bool:
    """``Bearer TOKEN`` or HTTP basic auth whose password is TOKEN (any user name)."""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return secrets.compare_digest(value.strip().encode(), token.encode())
    if scheme.lower() == "basic":
        try:
            password = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return False
        return secrets.compare_digest(password.encode(), token.encode())
    return False


def secret_from_env(option: str, env_name: str) -> str:
    """A token or secret named by a command's ``option`` (``--auth-token-env NAME``): the variable's value,
    or a ValueError (the command's one-line refusal, never showing the value) when it is unset or short."""
    value = os.environ.get(env_name, "")
    if len(value) < MIN_TOKEN_CHARS:
        problem = f"too short (under {MIN_TOKEN_CHARS} characters)" if value else "unset or empty"
        raise ValueError(f"{option} {env_name}: the variable is {problem}")
    return value


def service_token(host: str, env_name: str | None, host_option: str = "--host") -> str | None:
    """The token a service started on ``host`` asks for: read from ``env_name``; a ValueError (the
    command's one-line refusal) for a missing or short one, or for a host beyond loopback without one."""
    if env_name:
        return secret_from_env("--auth-token-env", env_name)
    if not is_loopback(host):
        raise ValueError(f"{host_option} {host} is reachable beyond this machine: pass --auth-token-env NAME (an environment "
                         f"variable holding the token clients send) or bind 127.0.0.1")
    return None


def unauthorized_body(service: str) -> dict:
    """The 401 answer's body, in OpenAI's error shape."""
    return {"error": {"message": f"this {service} needs its token (Authorization: Bearer TOKEN, or the token as the "
                                 f"HTTP basic-auth password)", "type": "authentication_error", "code": "unauthorized"}}


__all__ = ["authorized", "is_loopback", "secret_from_env", "service_token", "unauthorized_body"]
