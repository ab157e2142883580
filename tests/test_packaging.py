"""The package as a user installs it: a wheel built from the repository holds every file the CPU
backend needs (its C sources and the header they include), and installed into a fresh virtualenv,
away from this checkout, it builds the kernel from those files and computes with it."""

import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# What a clean clone has not: earlier builds (setuptools would pack build/lib's files) and run outputs.
NOT_SOURCES = shutil.ignore_patterns("build", "*.egg-info", ".venv", ".git", "runs", "outputs", "wandb", ".whl",
                                     "__pycache__", ".pytest_cache", ".ruff_cache")  # fmt: skip


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel --no-deps .` builds from a copy of the checkout without build outputs."""
    src, out = tmp_path_factory.mktemp("src") / "specdec", tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, src, ignore=NOT_SOURCES)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True)  # fmt: skip
    (built,) = out.glob("specdec-*.whl")
    return built


def test_the_wheel_holds_every_file_the_cpu_backend_needs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"specdec_runtime/cpu/csrc/{p.name}" for p in (ROOT / "specdec_runtime/cpu/csrc").iterdir()}
    assert sources and sources <= names, sources - names
    included = {
        line.split('"')[1]
        for p in (ROOT / "specdec_runtime/cpu/csrc").glob("*.c")
        for line in p.read_text().splitlines()
        if line.startswith('#include "')
    }
    assert included and {f"specdec_runtime/cpu/csrc/{h}" for h in included} <= names


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU kernel is built on Linux only")
def test_installed_in_a_fresh_virtualenv_it_builds_and_uses_the_kernel(wheel, tmp_path):
    """A fresh virtualenv (its dependencies, torch first, reached through a .pth to this
    environment's site-packages, after its own), the wheel installed into it, run from an empty
    folder with an empty kernel cache: the kernel is compiled from the installed sources and its
    product of a few rows equals torch's."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)  # fmt: skip
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after the wheel's own
    script = textwrap.dedent(
        """
        import sys, torch, specdec_runtime
        from specdec_runtime.cpu import kernel as cpu_kernel
        from specdec_runtime.paths import cache_root
        from specdec_runtime.layers import Weights, linear
        assert specdec_runtime.__file__.startswith(sys.argv[1]), specdec_runtime.__file__
        assert cpu_kernel.library() is not None, "the kernel was not built"
        torch.manual_seed(0)
        x, w = torch.randn(3, 256), torch.randn(256, 384)
        got = linear(x, Weights.from_matrix(w, None, True))
        assert torch.allclose(got, x @ w, atol=1e-3, rtol=1e-4)
        built = list((cache_root() / "kernels").glob("*.so"))
        assert len(built) == 1, built
        print("ok")
        """
    )
    cache, work = tmp_path / "cache", tmp_path / "empty"
    work.mkdir()
    env = {"SPECDEC_CACHE": str(cache), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([python, "-c", script, str(site)], cwd=work, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
