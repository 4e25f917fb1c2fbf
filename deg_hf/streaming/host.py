"""The host side of placement, without torch: how much host memory the store may use, and which
layers go to RAM and which to the disk cache. ``deg-hf plan`` reads it as the trainers do."""

from __future__ import annotations

import os


def available_host_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().available)


def total_host_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        import psutil

        return int(psutil.virtual_memory().total)


def budget_after_margin(available: int, total: int) -> int:
    """``available`` bytes less the margin kept for the OS, the dataloader workers and (on CPU)
    activations: 10% of the machine's ``total``, at least 2 GiB."""
    return max(0, available - max(2 * 2**30, total // 10))


def host_budget(host_mem_gb: float | None) -> int:
    """Bytes of host memory the store may use: ``host_mem_gb``, or the available memory less the
    margin (:func:`budget_after_margin`)."""
    if host_mem_gb is not None:
        return int(host_mem_gb * 2**30)
    return budget_after_margin(available_host_bytes(), total_host_bytes())


def plan_placement(tier: str, layer_bytes: list[int], budget: int) -> list[str]:
    """``"ram"`` or ``"disk"`` for each layer. ``auto`` keeps the first layers whose blocks fit
    ``budget`` in RAM and puts the rest on disk (the disk tier's small staging ring is not the store
    and is not counted)."""
    if tier == "ram":
        return ["ram"] * len(layer_bytes)
    if tier == "disk":
        return ["disk"] * len(layer_bytes)
    placement, used = [], 0
    for n in layer_bytes:
        fits = used + n <= budget and "disk" not in placement
        placement.append("ram" if fits else "disk")
        used += n if fits else 0
    return placement


def describe_placement(placement: list[str]) -> str:
    """``ram 0-39, disk 40-79`` style summary of a placement."""
    runs, start = [], 0
    for i in range(1, len(placement) + 1):
        if i == len(placement) or placement[i] != placement[start]:
            runs.append(f"{placement[start]} {start}" + (f"-{i - 1}" if i - 1 > start else ""))
            start = i
    return ", ".join(runs)
