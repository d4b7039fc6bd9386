"""Disk + memory kernel cache (DESIGN §1): sharded entries, hits without NVRTC, repair of damaged
entries, QATTN_NO_JIT, concurrent builders in two processes, entries() and clear(). CPU only:
kernels are compiled for a named arch and never loaded onto a GPU."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import qattn
from qattn.engine.spec import KernelSpec
from qattn.engine import compile as compiler
from qattn.engine import kernel as kernel_module
from qattn.engine.cache import BINARY, META, SOURCE, KernelCache, KernelNotCached
from qattn.engine.kernel import build_kernel

REPO = Path(__file__).resolve().parents[1]
# A spec that compiles fast (~1 s); every test builds this one unless it says otherwise.
SPEC = KernelSpec(recipe="f16", head_dim=32, arch="sm_80")
SPEC_ARGS = "recipe='f16', head_dim=32, arch='sm_80'"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("QATTN_CACHE_DIR", str(root))
    monkeypatch.delenv("QATTN_NO_JIT", raising=False)
    kernel_module._MEMORY.clear()
    yield root
    kernel_module._MEMORY.clear()


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """SPEC compiled once into a cache of its own; tests copy it instead of compiling again."""
    root = tmp_path_factory.mktemp("prebuilt")
    saved = dict(kernel_module._MEMORY)
    kernel_module._MEMORY.clear()
    try:
        kernel = build_kernel(SPEC, cache=KernelCache(root))
    finally:
        kernel_module._MEMORY.clear()
        kernel_module._MEMORY.update(saved)
    return root, kernel


@pytest.fixture
def warm_cache(cache_dir, prebuilt):
    """cache_dir holding a copy of the prebuilt SPEC entry; returns the kernel that built it."""
    root, kernel = prebuilt
    shutil.copytree(root, cache_dir)
    kernel_module._MEMORY.clear()
    return kernel


@pytest.fixture
def nvrtc_calls(monkeypatch):
    """Count real NVRTC compiles."""
    calls = []
    real = compiler.compile_cuda

    def counting(source, arch, spec_name, options=None, **kwargs):
        calls.append(spec_name)
        return real(source, arch, spec_name, options, **kwargs)

    monkeypatch.setattr(compiler, "compile_cuda", counting)
    return calls


def forbid_nvrtc(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("NVRTC was called on a cache hit")

    monkeypatch.setattr(compiler, "compile_cuda", boom)


def entry_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*/*") if p.is_dir() and not p.name.startswith("."))


def assert_valid_entry(path: Path, spec: KernelSpec) -> dict:
    meta = json.loads((path / META).read_text())
    binary = (path / BINARY).read_bytes()
    assert binary[:4] == b"\x7fELF"
    assert meta["payload_sha256"] == hashlib.sha256(binary).hexdigest()
    assert meta["name"] == spec.name and meta["spec"] == spec.as_dict()
    assert path.parent.name == meta["key"][:2] and len(meta["key"]) == 64
    assert path.name.startswith(spec.name + "-")
    assert (path / SOURCE).read_text().startswith(f"// {spec.name}:")
    return meta


def run_python(code: str, env_extra: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=str(REPO))


# ---- hit and miss ---------------------------------------------------------------------------

def test_first_build_writes_a_sharded_entry(cache_dir, nvrtc_calls):
    k = build_kernel(SPEC)
    assert nvrtc_calls == [SPEC.name]
    dirs = entry_dirs(cache_dir)
    assert len(dirs) == 1
    meta = assert_valid_entry(dirs[0], SPEC)
    assert dirs[0].parent.parent == cache_dir
    assert (dirs[0] / BINARY).read_bytes() == k.binary
    assert (dirs[0] / SOURCE).read_text() == k.source
    assert meta["options"] == compiler.cuda_options("sm_80") and meta["compiler"] == compiler.nvrtc_version()
    assert meta["resources"]["registers"] > 0 and meta["build_seconds"] > 0
    assert k.resources["registers"] == meta["resources"]["registers"]
    assert k.resources["threads"] == 32 * SPEC.tile.warps
    assert not [p for p in cache_dir.glob("*/.*")], "no temp or trash dirs left behind"
    # the memory layer: the same object, no second compile
    assert build_kernel(SPEC) is k and len(nvrtc_calls) == 1


def test_second_build_loads_from_disk_without_nvrtc(cache_dir, monkeypatch, nvrtc_calls):
    first = build_kernel(SPEC)
    assert nvrtc_calls == [SPEC.name]
    kernel_module._MEMORY.clear()
    forbid_nvrtc(monkeypatch)
    second = build_kernel(SPEC)
    assert second is not first
    assert second.binary == first.binary and second.source == first.source
    assert second.meta["key"] == first.meta["key"]
    assert second.resources == first.resources
    assert len(entry_dirs(cache_dir)) == 1


def test_distinct_specs_get_distinct_entries(cache_dir, nvrtc_calls):
    a = build_kernel(SPEC)
    b = build_kernel(SPEC.with_(causal=True))
    assert len(nvrtc_calls) == 2
    dirs = entry_dirs(cache_dir)
    assert len(dirs) == 2 and a.meta["key"] != b.meta["key"]
    assert {d.name.rsplit("-", 1)[0] for d in dirs} == {SPEC.name, SPEC.with_(causal=True).name}


def test_explicit_cache_object(tmp_path, cache_dir, nvrtc_calls):
    other = KernelCache(tmp_path / "elsewhere")
    build_kernel(SPEC, cache=other)
    assert len(entry_dirs(tmp_path / "elsewhere")) == 1
    assert not cache_dir.exists() or not entry_dirs(cache_dir)


# ---- repair ---------------------------------------------------------------------------------

def _damage_truncate(path: Path):
    data = (path / BINARY).read_bytes()
    (path / BINARY).write_bytes(data[: len(data) // 2])


def _damage_flip(path: Path):
    data = bytearray((path / BINARY).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / BINARY).write_bytes(bytes(data))


def _damage_empty(path: Path):
    (path / BINARY).write_bytes(b"")


def _damage_meta_json(path: Path):
    (path / META).write_text('{"key": "trunc')


def _damage_meta_hash(path: Path):
    meta = json.loads((path / META).read_text())
    meta["payload_sha256"] = "0" * 64
    (path / META).write_text(json.dumps(meta))


def _damage_missing_binary(path: Path):
    (path / BINARY).unlink()


def _damage_missing_source(path: Path):
    (path / SOURCE).unlink()


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_flip, _damage_empty, _damage_meta_json,
                                    _damage_meta_hash, _damage_missing_binary, _damage_missing_source],
                         ids=lambda f: f.__name__.replace("_damage_", ""))
def test_damaged_entry_is_rebuilt(cache_dir, warm_cache, monkeypatch, damage):
    good = warm_cache
    path = entry_dirs(cache_dir)[0]
    damage(path)
    kernel_module._MEMORY.clear()
    calls = []
    real = compiler.compile_cuda
    monkeypatch.setattr(compiler, "compile_cuda", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    rebuilt = build_kernel(SPEC)
    assert calls == [SPEC.name], "a damaged entry must be recompiled, not loaded"
    assert rebuilt.binary[:4] == b"\x7fELF" and len(rebuilt.binary) == len(good.binary)
    dirs = entry_dirs(cache_dir)
    assert dirs == [path]
    assert_valid_entry(path, SPEC)
    assert (path / BINARY).read_bytes() == rebuilt.binary
    # and the repaired entry is a real hit afterwards
    kernel_module._MEMORY.clear()
    forbid_nvrtc(monkeypatch)
    assert build_kernel(SPEC).binary == rebuilt.binary


def test_damaged_entry_under_no_jit_is_not_loaded(cache_dir, warm_cache, monkeypatch):
    _damage_truncate(entry_dirs(cache_dir)[0])
    kernel_module._MEMORY.clear()
    monkeypatch.setenv("QATTN_NO_JIT", "1")
    with pytest.raises(KernelNotCached):
        build_kernel(SPEC)


# ---- QATTN_NO_JIT ---------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_no_jit_miss_raises(cache_dir, monkeypatch, value):
    monkeypatch.setenv("QATTN_NO_JIT", value)
    forbid_nvrtc(monkeypatch)
    with pytest.raises(qattn.KernelNotCached) as info:
        build_kernel(SPEC)
    msg = str(info.value)
    assert SPEC.name in msg and "QATTN_NO_JIT" in msg and str(cache_dir) in msg
    assert not cache_dir.exists() or not entry_dirs(cache_dir)


def test_no_jit_hit_loads(cache_dir, warm_cache, monkeypatch):
    first = warm_cache
    monkeypatch.setenv("QATTN_NO_JIT", "1")
    forbid_nvrtc(monkeypatch)
    assert build_kernel(SPEC).binary == first.binary
    with pytest.raises(KernelNotCached):  # a different spec is still a miss
        build_kernel(SPEC.with_(causal=True))


def test_no_jit_off_values_compile(cache_dir, monkeypatch, nvrtc_calls):
    monkeypatch.setenv("QATTN_NO_JIT", "0")
    build_kernel(SPEC)
    assert nvrtc_calls == [SPEC.name]


# ---- other processes ------------------------------------------------------------------------

_BUILDER = """
import hashlib, os, sys, time
from pathlib import Path
import qattn
from qattn.engine.kernel import build_kernel
go = Path(sys.argv[1])
deadline = time.time() + 60
while not go.exists() and time.time() < deadline:
    time.sleep(0.005)
k = build_kernel(qattn.KernelSpec({spec}))
print(hashlib.sha256(k.binary).hexdigest(), k.meta['key'])
"""


def test_two_processes_build_the_same_kernel(cache_dir, tmp_path):
    go = tmp_path / "go"
    code = _BUILDER.format(spec=SPEC_ARGS).replace("sys.argv[1]", repr(str(go)))
    env = dict(os.environ, QATTN_CACHE_DIR=str(cache_dir),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("QATTN_NO_JIT", None)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=str(REPO)) for _ in range(2)]
    time.sleep(1.0)  # let both import, then release them together
    go.touch()
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
    lines = [out.split() for out, _ in results]
    assert lines[0][1] == lines[1][1]  # same key
    dirs = entry_dirs(cache_dir)
    assert len(dirs) == 1
    meta = assert_valid_entry(dirs[0], SPEC)
    assert meta["key"] == lines[0][1]
    # each process returned a binary that is a valid build of the kernel; the one on disk is one of them
    assert meta["payload_sha256"] in {lines[0][0], lines[1][0]}
    assert not [p for p in cache_dir.glob("*/.*")], "no temp or trash dirs left behind"
    assert len(KernelCache(cache_dir).entries()) == 1


def test_second_process_loads_without_compiling(cache_dir, warm_cache):
    first = warm_cache
    code = ("import hashlib, qattn\n"
            "from qattn.engine import compile as c\n"
            "def boom(*a, **k): raise SystemExit('NVRTC called')\n"
            "c.compile_cuda = boom\n"
            f"k = qattn.engine.kernel.build_kernel(qattn.KernelSpec({SPEC_ARGS}))\n"
            "print(hashlib.sha256(k.binary).hexdigest())\n")
    run = run_python(code, {"QATTN_CACHE_DIR": str(cache_dir), "QATTN_NO_JIT": "1"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == hashlib.sha256(first.binary).hexdigest()
    # and the same process set-up really refuses a miss (so the success above was a load)
    miss = run_python(code.replace("head_dim=32", "head_dim=64"),
                      {"QATTN_CACHE_DIR": str(cache_dir), "QATTN_NO_JIT": "1"})
    assert miss.returncode != 0 and "KernelNotCached" in miss.stderr


# ---- listing and clearing -------------------------------------------------------------------

def test_entries_and_clear(cache_dir, nvrtc_calls):
    cache = KernelCache()
    assert cache.root == cache_dir
    assert cache.entries() == [] and cache.clear() == 0
    build_kernel(SPEC)
    build_kernel(SPEC.with_(causal=True))
    (cache_dir / "ab").mkdir(parents=True, exist_ok=True)
    (cache_dir / "ab" / ".tmp-123-abc").mkdir()  # an in-flight build is not an entry
    (cache_dir / "ab" / ".tmp-123-abc" / META).write_text("{}")
    listed = cache.entries()
    assert sorted(e["name"] for e in listed) == sorted([SPEC.name, SPEC.with_(causal=True).name])
    for e in listed:
        assert Path(e["path"]).is_dir() and e["payload_sha256"] and e["spec"]["arch"] == "sm_80"
    assert cache.clear() == 2
    assert cache.entries() == [] and entry_dirs(cache_dir) == []
    # after clear, a build compiles again
    kernel_module._MEMORY.clear()
    build_kernel(SPEC)
    assert nvrtc_calls.count(SPEC.name) == 2


def test_clear_leaves_foreign_files(cache_dir, warm_cache):
    (cache_dir / "README").write_text("not ours")
    (cache_dir / "keepme").mkdir()
    assert KernelCache().clear() == 1
    assert (cache_dir / "README").read_text() == "not ours" and (cache_dir / "keepme").is_dir()


def test_default_root(monkeypatch, tmp_path):
    from qattn.engine.cache import default_root

    monkeypatch.delenv("QATTN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "xdg" / "qattn"
    monkeypatch.setenv("QATTN_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_root() == tmp_path / "explicit"


def test_content_key_covers_every_input():
    from qattn.engine.cache import content_key

    base = ("src", ["-a", "-b"], "nvrtc-13.0", "sm_80")
    k = content_key(*base)
    assert len(k) == 64 and k == content_key(*base)
    variants = [("src2", ["-a", "-b"], "nvrtc-13.0", "sm_80"), ("src", ["-a"], "nvrtc-13.0", "sm_80"),
                ("src", ["-a", "-b"], "nvrtc-13.1", "sm_80"), ("src", ["-a", "-b"], "nvrtc-13.0", "sm_90a"),
                ("src", ["-a-b"], "nvrtc-13.0", "sm_80")]
    assert len({content_key(*v) for v in variants} | {k}) == len(variants) + 1


def test_entries_ask_for_no_more_dynamic_shared_memory_than_they_can_take(monkeypatch):
    """A module's entries all get the main kernel's dynamic shared memory figure, capped per entry at the
    block's limit less its static arrays: a quantizer entry with 13 KB of static arrays beside a 217 KB
    attention kernel (i8-f16 m64n128w4s4) made the driver refuse the attribute, and so the call."""
    cupy = pytest.importorskip("cupy")
    from types import SimpleNamespace

    from cupy.cuda import driver, runtime

    from qattn.engine.tile import Tile

    spec = KernelSpec(kind="prefill", recipe="i8-f16", head_dim=128, arch="sm_90a", mma="wgmma",
                      tile=Tile(64, 128, 4, 4))
    kernel = kernel_module.Kernel(spec, "", b"", {})
    assert kernel.shared_bytes == 222336
    statics = {"": 0, "_stats_f16": 13312}
    ptrs = {}

    class Module:
        def load(self, binary):
            pass

        def get_function(self, name):
            suffix = name.removeprefix(kernel_module.entry_name(spec))
            ptrs[len(ptrs) + 1] = suffix
            return SimpleNamespace(ptr=len(ptrs))

    limits = {}
    monkeypatch.setattr(cupy.cuda.function, "Module", Module)
    monkeypatch.setattr(driver, "funcGetAttribute", lambda attr, ptr: statics[ptrs[ptr]])
    monkeypatch.setattr(driver, "funcSetAttribute", lambda ptr, attr, value: limits.update({ptrs[ptr]: value}))
    monkeypatch.setattr(runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(runtime, "deviceGetAttribute", lambda attr, device: 232448)  # the H200's per-block opt-in
    kernel.function()
    kernel.function("_stats_f16")
    assert limits == {"": 222336, "_stats_f16": 232448 - 13312}
