"""On-disk kernel cache (DESIGN §1): one directory per content-hash key, sharded by its first two
hex digits, holding the binary, the rendered source and meta.json. Entries are built in a temp
directory and renamed into place, so readers see whole entries or none; meta.json carries the
binary's sha256, and an entry whose payload does not match is rebuilt, never loaded."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..version import __version__

BINARY, SOURCE, META = "kernel.bin", "source.txt", "meta.json"


class KernelNotCached(RuntimeError):
    """QATTN_NO_JIT=1 and the kernel is not in the cache."""


def default_root() -> Path:
    env = os.environ.get("QATTN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qattn"


def jit_disabled() -> bool:
    return os.environ.get("QATTN_NO_JIT", "").strip().lower() in ("1", "true", "yes", "on")


def content_key(source: str, options: list[str], compiler: str, arch: str) -> str:
    h = hashlib.sha256()
    for part in (source, "\0".join(options), compiler, arch, __version__):
        h.update(part.encode())
        h.update(b"\x1f")
    return h.hexdigest()


@dataclass
class Entry:
    path: Path
    binary: bytes
    meta: dict


class KernelCache:
    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root is not None else default_root()

    def entry_dir(self, spec_name: str, key: str) -> Path:
        return self.root / key[:2] / f"{spec_name}-{key[:24]}"

    def load(self, spec_name: str, key: str) -> Entry | None:
        """The entry if it is whole and its payload hash matches; a damaged one is removed."""
        path = self.entry_dir(spec_name, key)
        if not path.exists():
            return None
        entry = _read_valid(path, key)
        if entry is None:
            _discard(path)
        return entry

    def store(self, spec_name: str, key: str, binary: bytes, source: str, meta: dict) -> Entry:
        final = self.entry_dir(spec_name, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
        tmp.mkdir()
        meta = dict(meta, key=key, payload_sha256=hashlib.sha256(binary).hexdigest())
        (tmp / BINARY).write_bytes(binary)
        (tmp / SOURCE).write_text(source)
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True))
        for _ in range(8):
            try:
                os.rename(tmp, final)
                return Entry(final, binary, meta)
            except OSError:  # another builder got there first, or a damaged entry is in the way
                existing = _read_valid(final, key)
                if existing is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                    return existing
                _discard(final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"kernel cache: could not place {final}")

    def entries(self) -> list[dict]:
        """meta.json of every whole entry."""
        found = []
        for meta_path in sorted(self.root.glob(f"*/*/{META}")):
            if meta_path.parent.name.startswith("."):
                continue
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                continue
            meta["path"] = str(meta_path.parent)
            found.append(meta)
        return found

    def clear(self) -> int:
        """Remove every entry; returns how many there were."""
        count = len(self.entries())
        if self.root.exists():
            for shard in self.root.iterdir():
                if shard.is_dir() and len(shard.name) == 2:
                    shutil.rmtree(shard, ignore_errors=True)
        return count


def _read_valid(path: Path, key: str) -> Entry | None:
    try:
        meta = json.loads((path / META).read_text())
        binary = (path / BINARY).read_bytes()
        if not (path / SOURCE).is_file():
            return None
    except (OSError, ValueError):
        return None
    if meta.get("key") != key or meta.get("payload_sha256") != hashlib.sha256(binary).hexdigest():
        return None
    return Entry(path, binary, meta)


def _discard(path: Path) -> None:
    """Move a damaged entry out of the way (atomically), then delete it."""
    trash = path.parent / f".trash-{uuid.uuid4().hex}"
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
