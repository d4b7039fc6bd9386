"""A regular (non-editable) `pip install .` into a fresh venv works away from the checkout: the
package and its templates (package data) are installed, every family renders, NVRTC compiles,
and the `qattn` console script runs.

The venv sees the site-packages of the interpreter running the tests (cupy, numpy, jinja2, ...:
the outer venv's when the suite itself runs in one, through a .pth file, since `--system-site-packages`
would show only the base interpreter's), so only qattn itself is installed. Where the system can build a wheel without fetching anything (setuptools >= 70.1, or
the wheel package), the build runs without isolation; otherwise pip fetches the build
requirements of pyproject.toml, as CI's `pip install -e .` does.
"""
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qattn.engine.spec import KernelSpec

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

# Checkout clutter the install must not depend on (and in-tree build output must not land in
# the shared checkout, so the install runs from a copy).
_NOT_COPIED = shutil.ignore_patterns(".git", ".venv", ".ci-venv", "build", "dist", "*.egg-info", "__pycache__",
                                     ".pytest_cache", ".benchmarks", "shared")


def _builds_wheels_offline() -> bool:
    try:
        return (importlib.util.find_spec("setuptools.command.bdist_wheel") is not None
                or importlib.util.find_spec("wheel") is not None)
    except ImportError:
        return False


def _clean_env(tmp: Path) -> dict:
    """The environment without anything that would put the checkout on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(QATTN_CACHE_DIR=str(tmp / "cache"), PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, venv bin dir, an empty working directory outside the checkout, env)."""
    tmp = tmp_path_factory.mktemp("install")
    venv = tmp / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a venv here: {made.stderr.strip()[-500:]}")
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / "python"
    _see_outer_packages(python)
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_COPIED)
    env = _clean_env(tmp)
    args = [str(python), "-m", "pip", "install", "--no-deps", "--quiet", str(src)]
    if _builds_wheels_offline():
        args.insert(-1, "--no-build-isolation")
    work = tmp / "work"
    work.mkdir()
    done = subprocess.run(args, capture_output=True, text=True, cwd=work, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return python, bindir, work, env


def _see_outer_packages(python: Path) -> None:
    """Put this interpreter's site-packages on the venv's path, after the venv's own (a .pth file of
    plain paths: their own .pth files, such as an editable install's finder, are not run)."""
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    outer = [p for p in (*site.getsitepackages(), site.getusersitepackages()) if Path(p).is_dir()]
    Path(purelib, "_qattn_test_outer_site.pth").write_text("".join(f"{p}\n" for p in outer))


def _run(args, installed, timeout=120):
    _, _, work, env = installed
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=work, env=env, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, args))[:200]}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


# Runs inside the venv: every module and template must come from the install, every family
# with a template must render, and one spec must compile with NVRTC.
_CHECK = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import qattn
    from qattn.engine import registry
    from qattn.engine.registry import RECIPES
    from qattn.engine.render import entry_name, render
    from qattn.engine.spec import KernelSpec
    from qattn.engine.compile import compile_cuda

    rendered = {}
    for name, rec in RECIPES.items():
        for backend, family in rec.families.items():
            spec = KernelSpec(recipe=name, head_dim=family.head_dims[0], backend=backend, arch=family.archs[-1])
            source = render(spec)
            assert entry_name(spec) in source, spec.name
            rendered[f"{name}/{backend}"] = spec.name
    spec = KernelSpec(recipe="f16", head_dim=64, arch="sm_90a")
    binary = compile_cuda(render(spec), spec.arch, spec.name)
    print(json.dumps({
        "file": qattn.__file__,
        "modules": sorted(m.__file__ for n, m in sys.modules.items()
                          if n.split(".")[0] == "qattn" and getattr(m, "__file__", None)),
        "templates": [str(d) for d in registry.template_dirs()],
        "families": len([f for f in registry.FAMILIES.values() if f.templates is not None]),
        "shipped": sorted(str(p.relative_to(Path(qattn.__file__).parent))
                          for p in Path(qattn.__file__).parent.rglob("*.j2")),
        "rendered": rendered,
        "compiled": spec.name,
        "elf": binary.data[:4] == b"\\x7fELF",
        "registers": binary.resources["registers"],
    }))
""")


def test_installed_package_renders_and_compiles(installed):
    python, bindir, _, _ = installed
    venv = bindir.parent.resolve()
    report = json.loads(_run([python, "-c", _CHECK], installed).stdout)
    assert Path(report["file"]).resolve().is_relative_to(venv), report["file"]
    outside = [f for f in report["modules"] if not Path(f).resolve().is_relative_to(venv)]
    assert not outside, f"imported from outside the venv: {outside}"
    assert len(report["templates"]) == 1 + report["families"] >= 4  # the shared device code, a folder per family
    assert all(Path(d).resolve().is_relative_to(venv) for d in report["templates"])
    shipped = {str(p.relative_to(ROOT / "qattn")) for p in (ROOT / "qattn").rglob("*.j2")}
    assert set(report["shipped"]) == shipped, "templates missing from the install (setup.cfg package_data)"
    # Every recipe/backend pair with a kernel rendered: f16 on both backends at least.
    from qattn.engine.registry import RECIPES
    assert set(report["rendered"]) == {f"{n}/{b}" for n, r in RECIPES.items() for b in r.families}
    assert {"f16/cuda", "f16/hip"} <= set(report["rendered"])
    assert report["compiled"] == KernelSpec(recipe="f16", head_dim=64, arch="sm_90a").name
    assert report["elf"] and report["registers"] > 0


def test_installed_console_script(installed):
    _, bindir, _, _ = installed
    script = bindir / "qattn"
    assert script.is_file(), "the qattn console script was not installed"
    listing = _run([script, "list"], installed).stdout
    for text in ("prefill", "f16", "bf16", "sm_90a", "gfx942"):
        assert text in listing
    source = _run([script, "gen", "prefill", "--format", "f16", "--head-dim", "64", "--arch", "sm_80"], installed).stdout
    assert KernelSpec(recipe="f16", head_dim=64, arch="sm_80").name in source
    assert 'extern "C"' in source
