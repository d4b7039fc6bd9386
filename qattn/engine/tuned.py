"""The kernels `qattn tune` measured fastest on this machine (a tile, and the matrix unit where the arch
has a choice): one JSON file, tuned.json, in the kernel cache directory ($QATTN_CACHE_DIR, default
~/.cache/qattn).

An entry is the winner of one sweep, keyed by what it was measured on (GPU name, driver version,
qattn version, arch) and what it is for (format, head dim, causal, shape class); it keeps every
candidate's median time so that the best tile over several shape classes can be worked out later.
Entries of another GPU, driver or qattn version stay in the file and are ignored. The table is an
optimisation: a file or entry that cannot be read is skipped with a warning, never an error, and
QATTN_TUNED=0 ignores it (the families' built-in tuned tables apply).
"""
from __future__ import annotations

import functools
import json
import math
import os
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..version import __version__
from .cache import default_root
from .shape_class import ShapeClass, sequence_heads_bucket
from .tile import Tile

FILE_NAME = "tuned.json"
SCHEMA = 1


def table_path() -> Path:
    return default_root() / FILE_NAME


def enabled() -> bool:
    """False when QATTN_TUNED is 0 (or false, no, off)."""
    return os.environ.get("QATTN_TUNED", "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Device:
    """What an entry was measured on; it applies only where all three match."""

    gpu: str
    driver: str
    qattn: str = __version__


def current_device() -> Device | None:
    """The current CUDA device, or None without one."""
    try:
        import cupy

        if not cupy.cuda.is_available():
            return None
        device_id = cupy.cuda.Device().id
    except Exception:  # no driver, no device
        return None
    return _device(device_id)


@functools.lru_cache(maxsize=None)
def _device(device_id: int) -> Device:
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
    return Device(name.decode() if isinstance(name, bytes) else str(name), driver_version())


def driver_version() -> str:
    """The NVIDIA kernel driver's version (e.g. 570.124.06) where Linux shows it, else the CUDA
    version the driver supports (e.g. CUDA 13.0)."""
    try:
        return Path("/sys/module/nvidia/version").read_text().strip()
    except OSError:
        import cupy

        version = cupy.cuda.runtime.driverGetVersion()
        return f"CUDA {version // 1000}.{version % 1000 // 10}"


@dataclass(frozen=True)
class TunedKernel:
    """A candidate of a sweep: a tile on a matrix unit (None: the arch's default unit for the format)
    with template options ((name, value) pairs where they differ from the family's default at the head
    dim). Its name is the tile's, with "@unit" for another unit and "+option" ("on") or
    "+option=value" for each such option (m128n128w8s2@wgmma+persistent)."""

    tile: Tile
    mma: str | None = None
    options: tuple = ()

    @property
    def name(self) -> str:
        options = "".join(f"+{n}" if v == "on" else f"+{n}={v}" for n, v in self.options)
        return self.tile.name + (f"@{self.mma}" if self.mma else "") + options

    @classmethod
    def from_name(cls, name: str) -> "TunedKernel":
        head, *named = str(name).split("+")
        tile, _, mma = head.partition("@")
        options = tuple((n, v or "on") for n, _, v in (o.partition("=") for o in named))
        return cls(Tile.from_name(tile), mma or None, tuple(sorted(options)))

    @classmethod
    def of(cls, spec) -> "TunedKernel":
        """A KernelSpec's (whose mma is None on the arch's default unit), naming each option whose value is not the
        one the spec would take without it (its default, as the family settles it on this tile)."""
        fam, given = spec.family, dict(spec.options)

        def implied(name):
            options = {**given, name: fam.option_default(name, spec.head_dim)}
            return (fam.settled_options(options, spec.tile, spec.head_dim) if fam.settled_options else options)[name]

        return cls(spec.tile, spec.mma, tuple(sorted((n, v) for n, v in given.items() if v != implied(n))))


@dataclass(frozen=True)
class TunedEntry:
    device: Device
    arch: str
    format: str
    head_dim: int
    causal: bool
    shape_class: ShapeClass
    kernel: TunedKernel  # the winner: the least median time in candidates
    candidates: dict  # kernel name -> median ms, every candidate timed
    shape: dict  # what was timed: batch, heads, kv_heads, queries, keys
    rejected: dict = field(default_factory=dict)  # kernel name -> why it was not timed
    default_tile: str = ""  # the built-in default's kernel name (in candidates where it was swept)
    tuned_at: str = ""

    @property
    def key(self) -> tuple:
        return self.device, self.arch, self.format, self.head_dim, self.causal, self.shape_class

    @property
    def ms(self) -> float:
        return self.candidates[self.kernel.name]

    def as_json(self) -> dict:
        return {"gpu": self.device.gpu, "driver": self.device.driver, "qattn": self.device.qattn, "arch": self.arch,
                "format": self.format, "head_dim": self.head_dim, "causal": self.causal,
                "queries": self.shape_class.queries, "keys": self.shape_class.keys, "gqa": self.shape_class.gqa,
                "sequence_heads": self.shape_class.sequence_heads,
                "tile": self.kernel.name, "ms": self.ms, "default_tile": self.default_tile, "shape": self.shape,
                "candidates": self.candidates, "rejected": self.rejected, "tuned_at": self.tuned_at}

    @classmethod
    def from_json(cls, d: dict) -> "TunedEntry":
        """Raises KeyError, TypeError or ValueError on a malformed entry."""
        candidates = {str(name): float(ms) for name, ms in d["candidates"].items()}
        if not all(math.isfinite(ms) and ms > 0 for ms in candidates.values()):
            raise ValueError("candidates: times must be positive")
        entry = cls(Device(str(d["gpu"]), str(d["driver"]), str(d["qattn"])), str(d["arch"]), str(d["format"]),
                    _integer(d["head_dim"]), _boolean(d["causal"]),
                    ShapeClass(d["queries"], d["keys"], d["gqa"], _sequence_heads(d)), TunedKernel.from_name(d["tile"]),
                    candidates,
                    dict(d["shape"]), dict(d.get("rejected", {})), str(d.get("default_tile", "")),
                    str(d.get("tuned_at", "")))
        if entry.kernel.name not in candidates:
            raise ValueError(f"tile: {entry.kernel.name} is not among the candidates timed")
        return entry


def _sequence_heads(d: dict) -> str:
    """An entry's sequence-heads bucket; entries stored before classes had one take it from the shape timed."""
    if "sequence_heads" in d:
        return d["sequence_heads"]
    return sequence_heads_bucket(_integer(d["shape"]["batch"]) * _integer(d["shape"]["heads"]))


def _integer(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _boolean(value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a bool, got {value!r}")
    return value


def load(path: Path | None = None) -> list[TunedEntry]:
    """Every entry of the table, of any device; [] where there is no table or it cannot be read."""
    path = table_path() if path is None else Path(path)
    try:
        stat = path.stat()
    except OSError:
        return []
    return list(_read(path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)  # keyed by the file's mtime and size: a rewrite is read anew, warnings once
def _read(path: Path, _mtime_ns: int, _size: int) -> tuple[TunedEntry, ...]:
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("entries"), list):
            raise ValueError(f"expected {{'schema': {SCHEMA}, 'entries': [...]}}")
    except (OSError, ValueError) as exc:
        warnings.warn(f"qattn: ignoring the tuned-tile table {path} ({exc}); `qattn tune` rewrites it", stacklevel=3)
        return ()
    entries = []
    for i, raw in enumerate(data["entries"]):
        try:
            entries.append(TunedEntry.from_json(raw))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            warnings.warn(f"qattn: ignoring entry {i} of the tuned-tile table {path} ({type(exc).__name__}: {exc})",
                          stacklevel=3)
    return tuple(entries)


def save(entries, path: Path | None = None) -> Path:
    """Add entries to the table, each replacing a stored one with its key; the file is replaced
    atomically (a reader sees the old table or the new one)."""
    path = table_path() if path is None else Path(path)
    merged = {e.key: e for e in load(path)}
    merged.update((e.key, e) for e in entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex}")
    tmp.write_text(json.dumps({"schema": SCHEMA, "entries": [e.as_json() for e in merged.values()]}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def lookup(format: str, head_dim: int, causal: bool, arch: str,
           shape_class: ShapeClass | None = None) -> TunedKernel | None:
    """The stored kernel for a call on the current GPU: the winner of shape_class where one is given
    (None where that class was not tuned), else the best over every class tuned (best_overall).
    None without a GPU, without a matching entry, or with QATTN_TUNED=0."""
    if not enabled() or not table_path().is_file():  # the common case costs one stat
        return None
    device = current_device()
    if device is None:
        return None
    mine = [e for e in load() if e.key[:5] == (device, arch, format, head_dim, causal)]
    if shape_class is not None:
        return next((e.kernel for e in mine if e.shape_class == shape_class), None)
    return best_overall(mine)


def stored(format: str, head_dim: int, causal: bool, arch: str, queries: str | None = None) -> list[TunedKernel]:
    """The winners stored for calls on the current GPU (of the query length bucket `queries` where given, e.g.
    "1K-4K"), one a kernel; [] without a GPU, a table or with QATTN_TUNED=0."""
    if not enabled() or not table_path().is_file():
        return []
    device = current_device()
    if device is None:
        return []
    mine = [e for e in load() if e.key[:5] == (device, arch, format, head_dim, causal)
            and (queries is None or e.shape_class.queries == queries)]
    return list(dict.fromkeys(e.kernel for e in mine))


def best_overall(entries: list[TunedEntry]) -> TunedKernel | None:
    """Of the kernels timed in every entry's sweep, the one with the least geometric mean of its time
    over each sweep's best (a call of unknown shape runs it); where no tile was timed in all of
    them, the winner of the latest sweep."""
    if not entries:
        return None
    common = set.intersection(*(set(e.candidates) for e in entries))
    if not common:
        return max(entries, key=lambda e: e.tuned_at).kernel

    def log_slowdown(name: str) -> float:
        return sum(math.log(e.candidates[name] / e.ms) for e in entries)

    return TunedKernel.from_name(min(sorted(common), key=log_slowdown))
