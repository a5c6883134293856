"""A wheel (``pip install .``, not ``-e``) holds every file the packages need at run time: the C kernels' sources
and the headers they include, which a worker compiles on the serving machine (gpu_worker/native_build.py)."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gpu_worker.native_build import compiler, load_library
from ipc.model_source import cache_root

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ipc", "gpu_worker", "scheduler_proc", "tokenizer_proc")


@functools.cache
def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return out.stdout.split()


@pytest.fixture(scope="module")
def wheel_tree(tmp_path_factory) -> tuple[set[str], Path]:
    """The wheel built from a copy of the tracked files (the checkout itself is left untouched), unpacked."""
    pytest.importorskip("setuptools")
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    for name in _tracked():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    build = subprocess.run(
        [*pip, "-w", str(base / "dist"), "."],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (whl,) = (base / "dist").glob("*.whl")
    with zipfile.ZipFile(whl) as z:
        z.extractall(base / "unpacked")
        return set(z.namelist()), base / "unpacked"


def test_wheel_holds_every_tracked_package_file(wheel_tree):
    names, _ = wheel_tree
    wanted = [n for n in _tracked() if n.split("/")[0] in PACKAGES]
    missing = [n for n in wanted if n not in names]
    assert not missing, f"the wheel lacks {missing}: add them to [tool.setuptools.package-data] in pyproject.toml"
    assert "launch.py" in names


def test_every_kernel_include_is_in_the_wheel(wheel_tree):
    names, _ = wheel_tree
    sources = [n for n in names if n.startswith("gpu_worker/csrc/")]
    assert any(n.endswith(".c") for n in sources)
    for n in sources:
        text = (ROOT / n).read_text()
        for inc in re.findall(r'#include\s+"([^"]+)"', text):
            assert f"gpu_worker/csrc/{inc}" in names, f"{n} includes {inc}, which the wheel lacks"


@pytest.mark.skipif(compiler() is None, reason="no C compiler")
def test_kernels_compile_from_the_installed_files(wheel_tree):
    _, tree = wheel_tree
    # the workers' own kernel cache: its key hashes the source with every header beside it, so a hit means the
    # wheel's files equal the checkout's and a missing header means a build from the wheel's folder, which fails
    for source in sorted((tree / "gpu_worker" / "csrc").glob("*.c")):
        lib, note = load_library(source, cache_root() / "kernels")
        assert lib is not None, f"{source.name} does not build from the wheel's files: {note}"
