"""Hardware profiles for the analytic cost model: peak flops, HBM, and link bandwidth per mesh axis.

One table, :data:`PROFILES`, keyed by the names ``jaxpar plan --hardware`` accepts. Every number is
per device and comes from the vendor's data sheet named in the comment next to it; where a sheet
does not give a number, the comment says "assumed" and why.

Peak flops are dense (no sparsity) bf16, in :data:`PEAK_FLOPS`, the table the trainer's MFU uses
too (:func:`peak_flops`), so a plan's MFU and a run's MFU share one denominator.

A collective over one mesh axis moves ``wire_bytes`` per device; its time is ``wire_bytes /
bandwidth`` of the link that axis uses (NVLink or the network on GPUs, ICI or DCN on TPUs), plus
a fixed ``latency_s`` per launch. The latencies are assumed round numbers of the right order:
they keep layouts whose shards are tiny from ranking first on bandwidth alone. ``cpu`` is a
*nominal* laptop, useful only to exercise the planner. Which axis takes which link:
docs/cost-model.md, "Links and latency".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from jaxpar.config import MESH_AXES, ConfigError, DcnConfig

GB = 1e9  # vendors quote link bandwidth in decimal gigabytes (or gigabits: / 8)
GIB = 2**30


# Dense bf16 peak FLOP/s per chip, from the vendors' data sheets.
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU v6 lite": 918e12,  # v6e
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,
    "TPU v4": 275e12,
}


def peak_flops(device_kind: str) -> float | None:
    """Peak FLOP/s of one device of this kind, or None if the table does not know it."""
    for name, flops in PEAK_FLOPS.items():  # most specific names come first
        if name.lower() in device_kind.lower():
            return flops
    return None



@dataclass(frozen=True)
class HardwareProfile:
    """One device kind, per device."""

    name: str  # the key in PROFILES
    description: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: int  # device memory
    fast_link: str  # e.g. "NVLink", "ICI"
    fast_bytes_per_s: float  # send bandwidth for an axis inside one fast domain
    slow_link: str  # e.g. "network", "DCN"
    slow_bytes_per_s: float  # send bandwidth for an axis that leaves the domain
    domain_size: int  # devices that share the fast links (GPUs per node, chips per slice)
    fast_latency_s: float  # fixed cost of one collective on the fast links (assumed)
    slow_latency_s: float  # ... and on the slow ones (assumed)
    nominal: bool = False  # True: made-up round numbers, not a data sheet
    device_kind: str = ""  # its name in PEAK_FLOPS, as jax's Device.device_kind spells it

    @property
    def platform(self) -> str:
        """jax's name of the backend: cpu, tpu or gpu."""
        return self.name if self.name == "cpu" else "tpu" if self.name.startswith("tpu") else "gpu"

    def axis_link(self, mesh_shape: Mapping[str, int], axis: str | tuple[str, ...],
                  dcn: DcnConfig | None = None) -> tuple[str, float]:
        """(link name, send bytes/s) a collective over ``axis`` (or several axes) gets.

        Devices are numbered with the innermost mesh axis fastest, so an axis's group spans
        ``size(axis) * size(every axis inside it)`` consecutive devices; it stays in one domain
        when that span is at most ``domain_size`` (domains are assumed aligned to it). With
        ``dcn`` over several slices, the slices are the domains (module docstring).
        """
        if self._in_domain(mesh_shape, axis, dcn):
            return self.fast_link, self.fast_bytes_per_s
        return self.slow_link, self.slow_bytes_per_s

    def axis_latency(self, mesh_shape: Mapping[str, int], axis: str | tuple[str, ...],
                     dcn: DcnConfig | None = None) -> float:
        """Seconds one collective over ``axis`` costs before its bytes (module docstring)."""
        return (self.fast_latency_s if self._in_domain(mesh_shape, axis, dcn)
                else self.slow_latency_s)

    def _in_domain(self, mesh_shape: Mapping[str, int], axis: str | tuple[str, ...],
                   dcn: DcnConfig | None = None) -> bool:
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        if dcn is not None and dcn.slices > 1:
            return not dcn.crossing(axes)
        outermost = min(MESH_AXES.index(a) for a in axes)
        span = math.prod(mesh_shape.get(a, 1) for a in MESH_AXES[outermost:])
        return span <= self.domain_size


def _gpu(name: str, description: str, peak_key: str, hbm_gib: float, nvlink_gbps: float,
         nic_gbit: float) -> HardwareProfile:
    """A GPU in an 8-GPU node: NVLink inside the node, one NIC per GPU between nodes.

    ``nvlink_gbps`` is the data sheet's total (both directions) NVLink bandwidth in GB/s; a GPU
    sends at half of it. ``nic_gbit`` is the per-GPU network port in Gbit/s.
    """
    return HardwareProfile(
        name=name, description=description, peak_flops=PEAK_FLOPS[peak_key], device_kind=peak_key,
        hbm_bytes=int(hbm_gib * GIB), fast_link="NVLink", fast_bytes_per_s=nvlink_gbps / 2 * GB,
        slow_link="network", slow_bytes_per_s=nic_gbit / 8 * GB, domain_size=8,
        # Assumed: NCCL's small-message floor, ~10 us inside a node (NVSwitch), a few times that
        # through the NICs and switches between nodes.
        fast_latency_s=10e-6, slow_latency_s=30e-6)


def _tpu(name: str, description: str, peak_key: str, hbm_gib: float, ici_bidir_gbps: float,
         ici_ports: int, dcn_gbit_per_chip: float, slice_chips: int) -> HardwareProfile:
    """A TPU chip: one mesh axis rides one torus dimension, i.e. 2 of ``ici_ports`` links."""
    return HardwareProfile(
        name=name, description=description, peak_flops=PEAK_FLOPS[peak_key], device_kind=peak_key,
        hbm_bytes=int(hbm_gib * GIB), fast_link="ICI",
        fast_bytes_per_s=ici_bidir_gbps / ici_ports * GB, slow_link="DCN",
        slow_bytes_per_s=dcn_gbit_per_chip / 8 * GB, domain_size=slice_chips,
        # Assumed: ~10 us per collective on ICI; DCN goes through the hosts' network stacks.
        fast_latency_s=10e-6, slow_latency_s=100e-6)


PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA H100 Tensor Core GPU data sheet (SXM5): 989 TFLOPS dense BF16, 80 GB HBM3, NVLink
    # 900 GB/s; DGX H100 user guide: 8x ConnectX-7 400 Gb/s InfiniBand/Ethernet, one per GPU.
    "h100": _gpu("h100", "NVIDIA H100 SXM5 80GB, 8 per node, 400 Gb/s NIC per GPU", "H100",
                 80, nvlink_gbps=900, nic_gbit=400),
    # NVIDIA H200 Tensor Core GPU data sheet (SXM): 989 TFLOPS dense BF16, 141 GB HBM3e, NVLink
    # 900 GB/s; DGX H200: 8x ConnectX-7 400 Gb/s, one per GPU.
    "h200": _gpu("h200", "NVIDIA H200 SXM 141GB, 8 per node, 400 Gb/s NIC per GPU", "H200",
                 141, nvlink_gbps=900, nic_gbit=400),
    # NVIDIA A100 Tensor Core GPU data sheet (SXM4 80GB): 312 TFLOPS dense BF16, NVLink 600 GB/s;
    # DGX A100: 8x ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU.
    "a100": _gpu("a100", "NVIDIA A100 SXM4 80GB, 8 per node, 200 Gb/s NIC per GPU", "A100",
                 80, nvlink_gbps=600, nic_gbit=200),
    # Google Cloud "TPU v4" page: 275 TFLOPS bf16, 32 GiB HBM2, 3D torus, pod of 4096 chips.
    # ICI per link: ~50 GB/s each way over 6 links (TPU v4 ISCA 2023 paper; the Cloud page gives
    # no per-chip figure), i.e. 600 GB/s bidirectional. DCN: not on the page; assumed 25 Gb/s
    # per chip like v5e.
    "tpu-v4": _tpu("tpu-v4", "Google TPU v4 (3D torus)", "TPU v4", 32, ici_bidir_gbps=600,
                   ici_ports=6, dcn_gbit_per_chip=25, slice_chips=4096),
    # Google Cloud "TPU v5e" page: 197 TFLOPS bf16, 16 GiB HBM2, 400 GB/s bidirectional ICI per
    # chip over 4 ports (2D torus), pod of 256; 2 x 100 Gb/s NICs per 8-chip host = 25 Gb/s/chip.
    "tpu-v5e": _tpu("tpu-v5e", "Google TPU v5e (2D torus)", "TPU v5 lite", 16,
                    ici_bidir_gbps=400, ici_ports=4, dcn_gbit_per_chip=25, slice_chips=256),
    # Google Cloud "TPU v5p" page: 459 TFLOPS bf16, 95 GiB usable HBM2e, 1200 GB/s bidirectional
    # ICI per chip (3D torus, 6 ports), DCN 50 Gb/s per chip, largest slice 6144 chips.
    "tpu-v5p": _tpu("tpu-v5p", "Google TPU v5p (3D torus)", "TPU v5p", 95,
                    ici_bidir_gbps=1200, ici_ports=6, dcn_gbit_per_chip=50, slice_chips=6144),
    # Google Cloud "TPU v6e" (Trillium) page: 918 TFLOPS bf16, 32 GB HBM, 800 GB/s bidirectional
    # ICI per chip over 4 ports (2D torus), pod of 256. DCN: not on the page; assumed 25 Gb/s
    # per chip like v5e.
    "tpu-v6e": _tpu("tpu-v6e", "Google TPU v6e Trillium (2D torus)", "TPU v6 lite", 32,
                    ici_bidir_gbps=800, ici_ports=4, dcn_gbit_per_chip=25, slice_chips=256),
    # NOMINAL: a laptop's virtual CPU devices (one process). Round numbers, not a data sheet:
    # ~1 TFLOP/s of fp32 SIMD, 16 GiB of RAM, ~10 GB/s memcpy standing in for links.
    "cpu": HardwareProfile(
        name="cpu", description="nominal laptop CPU (virtual devices; round numbers, not "
        "measured)", peak_flops=1e12, hbm_bytes=16 * GIB, fast_link="memcpy",
        fast_bytes_per_s=10 * GB, slow_link="memcpy", slow_bytes_per_s=10 * GB,
        domain_size=1 << 30, fast_latency_s=10e-6, slow_latency_s=10e-6, nominal=True),
}


def profile_of(device_kind: str) -> HardwareProfile:
    """The profile of the devices a run has (``jax.Device.device_kind``), matched as
    :func:`peak_flops` matches it; the nominal ``cpu`` profile for a kind the table lacks."""
    for name in PEAK_FLOPS:  # most specific names come first
        if name.lower() in device_kind.lower():
            return next((p for p in PROFILES.values() if p.device_kind == name), PROFILES["cpu"])
    return PROFILES["cpu"]


def get_profile(name: str | HardwareProfile) -> HardwareProfile:
    """The profile called ``name`` (case-insensitive); a ConfigError lists the known names."""
    if isinstance(name, HardwareProfile):
        return name
    key = name.strip().lower()
    if key not in PROFILES:
        raise ConfigError(f"--hardware {name!r}: unknown; allowed values: "
                          + ", ".join(PROFILES))
    return PROFILES[key]
