"""Tile shape of a kernel: query rows and keys per block, warps, pipeline stages."""
from __future__ import annotations

import re
from dataclasses import dataclass

_TILE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
_NAME_RE = re.compile(r"^m(\d+)n(\d+)w(\d+)s(\d+)$")


@dataclass(frozen=True)
class Tile:
    block_m: int  # query rows per thread block
    block_n: int  # keys per K/V tile
    warps: int  # warps (CUDA) or waves (HIP) per block
    stages: int = 2  # K/V tiles in flight (cp.async pipeline depth)

    def __post_init__(self):
        for field_name in ("block_m", "block_n", "warps", "stages"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"tile.{field_name}: expected a positive integer, got {value!r}")

    @property
    def name(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}"

    @classmethod
    def parse(cls, text: str, warps: int, stages: int) -> "Tile":
        """'128x64' plus warps and stages -> Tile."""
        match = _TILE_RE.match(text)
        if not match:
            raise ValueError(f"tile: expected BLOCK_MxBLOCK_N such as 128x64, got {text!r}")
        return cls(int(match.group(1)), int(match.group(2)), warps, stages)

    @classmethod
    def from_name(cls, name: str) -> "Tile":
        """The tile whose .name is name ('m128n64w4s2' -> Tile(128, 64, 4, 2))."""
        match = _NAME_RE.match(name)
        if not match:
            raise ValueError(f"tile: expected a tile name such as m128n64w4s2, got {name!r}")
        return cls(*map(int, match.groups()))
