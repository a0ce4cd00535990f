"""A fake Hugging Face cache in the real layout, written from folders saved with save_pretrained.

models--{org}--{name}/blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, and
refs/<branch or tag> holding the commit: what `hf download` leaves behind.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest


def add_to_cache(cache: Path, repo: str, folder: Path, refs: tuple[str, ...] = ("main",), commit: str | None = None) -> str:
    """Store every file of `folder` as one commit of `repo`; returns the commit hash."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    if commit is None:
        digest = hashlib.sha1()
        for p in files:
            digest.update(p.name.encode() + p.read_bytes())
        commit = digest.hexdigest()
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for p in files:
        data = p.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (root / "blobs" / blob).write_bytes(data)
        link = snapshot / p.name
        if not link.exists():
            os.symlink(Path("..", "..", "blobs", blob), link)
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return commit


@pytest.fixture()
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test loudly."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a test tried to open a network connection: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.fixture()
def fake_hub(tmp_path, monkeypatch, no_network):
    """An empty cache that HF_HUB_CACHE names, with HF_HUB_OFFLINE=1. huggingface_hub reads
    its environment once at import, so its constants are pointed there as well."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache
