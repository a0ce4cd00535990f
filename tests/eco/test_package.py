"""The distribution: wheel and sdist carry the page; an installed copy (not -e, not this checkout)
serves the page and every asset; `manyeyes` never collides with a user's own app/ or model.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.eco.conftest import ROOT, live_server

pytestmark = pytest.mark.slow
PAGE_FILES = ("manyeyes/templates/index.html", "manyeyes/static/css/app.css", "manyeyes/static/js/main.js",
              "manyeyes/model/data/tiny-gpt/model.pth", "manyeyes/offline_api.js")


def clean_env() -> dict[str, str]:
    """No PYTHONPATH: nothing may resolve to this checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


STALE = "manyeyes/static/js/deleted_since.js"  # a file of an older build, its source since deleted
# Not copied: what .gitignore keeps out of a checkout, whose build/ this test plants itself.
NOT_SOURCE = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".venv", "venv", "*.egg-info", "build", "dist",
                                    ".pytest_cache", "test-artifacts", "node_modules", ".whl")


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist, and the wheel built from it (`python -m build`'s default), from a copy of this
    checkout whose build/lib holds a file of an older build: a wheel built straight from a
    checkout (`--wheel`) reuses its build/lib, and shipped files deleted from the sources."""
    out = tmp_path_factory.mktemp("dist")
    source = tmp_path_factory.mktemp("checkout") / "manyeyes"
    shutil.copytree(ROOT, source, ignore=lambda folder, names: [
        *NOT_SOURCE(folder, names), *(["out"] if Path(folder) == ROOT / "bench" else [])])
    (source / "build" / "lib" / STALE).parent.mkdir(parents=True)
    (source / "build" / "lib" / STALE).write_text("export const gone = true;\n")
    # No build isolation: the build backend (setuptools) is already here and no index is needed.
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
                          check=True, capture_output=True, text=True, env=clean_env())
    (out / "build.log").write_text(done.stdout + done.stderr)
    return out


def test_the_wheel_holds_only_what_the_sdist_holds(dist):
    """README's build command made the wheel from the checkout, where an old build/lib shipped
    files since deleted; built from the sdist, every file of the wheel is a source file."""
    [wheel] = dist.glob("*.whl")
    names = [n for n in zipfile.ZipFile(wheel).namelist() if not n.split("/")[0].endswith(".dist-info")]
    assert STALE not in names
    [sdist] = dist.glob("*.tar.gz")
    members = {m.split("/", 1)[1] for m in tarfile.open(sdist).getnames() if "/" in m}
    folders = {"app", "model", "static", "templates"}  # pyproject's package-dir: manyeyes/<folder> is <folder>/
    sources = [n.split("/", 1)[1] if n.split("/")[1] in folders else n for n in names]
    assert not set(sources) - members, sorted(set(sources) - members)[:20]


def test_the_build_lists_every_package_it_ships(dist):
    """The data folders (model/data, static/css, static/js) were importable names missing from
    `packages`: setuptools warned three times that it "would ignore" them in a later version."""
    log = (dist / "build.log").read_text()
    assert "would be ignored" not in log, log[log.find("would be ignored") - 300:][:900]


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """A fresh venv holding only the wheel; its dependencies come from the dev venv through a .pth
    line, which sys.path puts after the venv's own site-packages, so the wheel's manyeyes wins."""
    home = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True)
    site = Path(subprocess.check_output([home / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    (site / "dev-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    [wheel] = dist.glob("*.whl")
    # --ignore-installed: without it pip uninstalls the running environment's own manyeyes (the
    # developer's editable install, and its console script) before installing into the prefix.
    subprocess.run([sys.executable, "-m", "pip", "install", "--ignore-installed", "--no-deps", "--no-compile",
                    "--prefix", str(home), str(wheel)],
                   check=True, capture_output=True, env=clean_env())
    return home


def test_wheel_and_sdist_hold_the_page_and_the_models(dist):
    [wheel] = dist.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(PAGE_FILES) <= names
    assert not any(n.startswith(("app/", "model/", "static/", "templates/")) for n in names)  # no generic top-level names
    [sdist] = dist.glob("*.tar.gz")
    members = {m.split("/", 1)[1] for m in tarfile.open(sdist).getnames() if "/" in m}
    assert {"templates/index.html", "static/js/main.js", "static/css/app.css", "manyeyes/offline_api.js", "model/data/tiny-gpt/model.pth"} <= members


def test_the_sdist_holds_what_its_tests_need(dist):
    """setuptools took tests/test_*.py alone: no conftest, no fake Hub cache, no subfolder, no bench
    script or notebook, so an unpacked sdist could not run one test."""
    [sdist] = dist.glob("*.tar.gz")
    members = {m.split("/", 1)[1] for m in tarfile.open(sdist).getnames() if "/" in m}
    needed = {str(path.relative_to(ROOT)) for folder in ("tests", "bench", "examples") for path in (ROOT / folder).rglob("*")
              if path.is_file() and "__pycache__" not in path.parts and not path.is_relative_to(ROOT / "bench" / "out")}
    assert {"tests/conftest.py", "tests/hub_cache.py", "tests/api/conftest.py", "bench/mutants.py"} <= needed
    assert not needed - members, sorted(needed - members)[:20]
    assert {"SECURITY.md", "Dockerfile", "README.md", "pyproject.toml"} <= members
    assert not [m for m in members if "__pycache__" in m or m.endswith(".pyc")]


def test_installed_copy_serves_the_page_and_every_asset_from_itself(venv, dist, tmp_path):
    python = venv / "bin" / "python"
    where = subprocess.check_output(
        [python, "-c", "import manyeyes, manyeyes.app.routes.page as p; print(manyeyes.__file__); print(p.TEMPLATES_DIR)"],
        cwd=tmp_path, env=clean_env(), text=True,
    ).split()
    assert all(Path(w).is_relative_to(venv) for w in where), where
    [wheel] = dist.glob("*.whl")
    packed = zipfile.ZipFile(wheel)
    env_backup = os.environ.get("PYTHONPATH")
    os.environ.pop("PYTHONPATH", None)
    try:
        with live_server(cwd=tmp_path, python=str(python)) as base:
            page = httpx.get(base + "/")
            assert page.status_code == 200 and "manyeyes" in page.text
            assets = ["/" + a for a in re.findall(r'(?:src|href)="((?:static|vendor)/[^"?]+)', page.text)]
            assert "/static/js/main.js" in assets and "/vendor/plotly.min.js" in assets
            modules, seen = ["main.js"], set()
            while modules:  # every module the page imports, transitively
                name = modules.pop()
                if name in seen:
                    continue
                seen.add(name)
                r = httpx.get(f"{base}/static/js/{name}")
                assert r.status_code == 200 and r.content == packed.read(f"manyeyes/static/js/{name}")
                modules += re.findall(r"""(?:from|import)\s*\(?\s*["']\./([\w.-]+\.js)""", r.text)
                modules += re.findall(r"""new URL\(["']\./([\w.-]+\.js)""", r.text)
            assert {"main.js", "api.js", "grid.js", "fetch-worker.js"} <= seen
            for path in assets:
                r = httpx.get(base + path)
                assert r.status_code == 200 and len(r.content) > 0, path
            css = httpx.get(base + "/static/css/app.css").content
            assert css == packed.read("manyeyes/static/css/app.css")
            assert httpx.get(base + "/docs").status_code == 200
    finally:
        if env_backup is not None:
            os.environ["PYTHONPATH"] = env_backup


USER_MODEL = "def load(*args, **kwargs):\n    return 'the user model'\n"
USER_APP = "NAME = 'the user app'\n"


def check_from_user_dir(python: str, folder: Path, env: dict[str, str], cli: list[str]) -> None:
    (folder / "app").mkdir(exist_ok=True)
    (folder / "app" / "__init__.py").write_text(USER_APP)
    (folder / "model.py").write_text(USER_MODEL)
    code = (
        "import app, model\n"
        "from manyeyes import load, Client\n"
        "assert model.load() == 'the user model' and app.NAME == 'the user app'\n"
        "m = load('tiny-gpt', device='cpu')\n"
        "assert m.attend('In the beginning').attention.shape[:2] == (2, 8)\n"
        "import manyeyes.model, manyeyes.app\n"
        "print('ok', Client.__module__)\n"
    )
    out = subprocess.run([python, "-c", code], cwd=folder, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "ok manyeyes.client" in out.stdout, out.stderr
    out = subprocess.run([*cli, "attend", "In the beginning", "--model", "tiny-gpt", "--layer", "0", "--head", "3"],
                         cwd=folder, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "layer 0, head 3" in out.stdout, out.stderr


def test_a_users_app_and_model_py_do_not_collide_installed(venv, tmp_path):
    # The console script, run by the venv's interpreter (pip, run from the dev venv, wrote its shebang).
    python = str(venv / "bin" / "python")
    check_from_user_dir(python, tmp_path, clean_env(), [python, str(venv / "bin" / "manyeyes")])


def test_a_users_app_and_model_py_do_not_collide_from_the_checkout(tmp_path):
    env = {**clean_env(), "PYTHONPATH": str(ROOT)}
    check_from_user_dir(sys.executable, tmp_path, env, [sys.executable, "-m", "manyeyes"])


def test_the_wheel_carries_its_license(dist):
    """pyproject's license was a TOML table, which setuptools stops building on 2027-02-18, and no
    LICENSE file shipped with the wheel."""
    [wheel] = dist.glob("*.whl")
    archive = zipfile.ZipFile(wheel)
    [metadata] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    assert "License-Expression: MIT" in archive.read(metadata).decode().splitlines()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in archive.namelist())
