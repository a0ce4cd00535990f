"""Waiting for a server the tests started, in one place for every suite (api, browser, eco,
reliability): a free loopback port, and a poll until it is ready that fails at once when the
server's process exits instead of waiting out its whole deadline."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx

HOST = "127.0.0.1"  # the only address these tests ever send traffic to


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen | None = None, *, timeout_s: float = 120,
               route: str = "/readyz", what: str = "the server") -> None:
    """Until `base + route` answers 200 (/healthz: the server is up, its models maybe still
    loading); an AssertionError when `proc` exits first or `timeout_s` pass."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what} exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base}{route}", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} at {base}{route} did not say 200 within {timeout_s:g} s")
        time.sleep(0.1)


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.02):
    """predicate()'s first true value, polled; an AssertionError naming `what` after timeout_s.
    A test waits for the state it needs, not for a time that a loaded machine outlasts."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
