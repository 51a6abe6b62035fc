"""Device profiles: which GE option file and which dtypes each Atlas target (or the CPU) takes."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Tuple

from export.errors import ExportError

GE_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ge_configs")


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    hardware: str
    soc: str  # "" for the CPU
    dtypes: Tuple[str, ...]  # dtypes the device has kernels for; the first is the default
    # default prompt-length buckets (default_buckets): first, first*factor, ... below seq_length
    bucket_first: int = 128
    bucket_factor: int = 4

    @property
    def default_dtype(self) -> str:
        return self.dtypes[0]

    @property
    def ini_path(self) -> str:
        return os.path.join(GE_CONFIG_DIR, f"{self.name}.ini")


PROFILES: Dict[str, DeviceProfile] = {
    "atlas_800i_a2": DeviceProfile("atlas_800i_a2", "Atlas 800I A2", "Ascend910B", ("float16", "bfloat16", "float32")),
    "atlas_800t_a2": DeviceProfile("atlas_800t_a2", "Atlas 800T A2", "Ascend910B", ("float16", "bfloat16", "float32")),
    "atlas_800": DeviceProfile("atlas_800", "Atlas 800", "Ascend910A", ("float16", "float32")),
    "atlas_300i_duo": DeviceProfile("atlas_300i_duo", "Atlas 300I Duo", "Ascend310P", ("float16",)),
    # CPU folders compute in float32; float16 and bfloat16 store the matrices in 16 bits (ExportConfig.compute_dtype)
    "cpu": DeviceProfile("cpu", "CPU", "", ("float32", "bfloat16", "float16"), bucket_first=16, bucket_factor=2),
}
DEFAULT_PROFILE = "atlas_800i_a2"


def get_profile(name: str) -> DeviceProfile:
    """The profile by name; an unknown name fails listing the known ones."""
    try:
        profile = PROFILES[name]
    except KeyError:
        raise ExportError(f"--device {name!r} is not a known profile; known: {', '.join(PROFILES)}") from None
    if not os.path.isfile(profile.ini_path):
        raise ExportError(f"{profile.ini_path}: GE option file of profile {name!r} is missing; "
                          "reinstall from a full checkout (pip install -e .)")
    return profile


def default_buckets(profile: DeviceProfile, seq_length: int) -> Tuple[int, ...]:
    """The prompt-length buckets an export gets without --prefill_buckets (the seq_length graph comes on top).

    The rule: `bucket_first`, times `bucket_factor`, ... while below seq_length.
    - CPU: 16, 32, 64, ... Prefill there is compute-bound, so a prompt's cost is its bucket's length: doubling
      keeps the padding under 2x (a 100-token prompt runs on 128), and a graph costs only seconds to export and
      to compile on first use (the runtime compiles the others when a prompt needs them).
    - Atlas: 128, 512, 2048, ... GE compiles each graph for minutes when the folder loads, and the NPU's
      prefill is cheap next to that, so four times apart keeps the set small (2 extra graphs at 2048).
    """
    sizes = []
    size = profile.bucket_first
    while size < seq_length:
        sizes.append(size)
        size *= profile.bucket_factor
    return tuple(sizes)
