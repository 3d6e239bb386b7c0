"""What /proc says about a process and the machine, for the benchmarks that watch consortium processes run
(load.py, soak.py): read while the processes live, since their peaks are gone once they exit."""

from __future__ import annotations

import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def status_kb(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
    """Fields of /proc/<pid>/status in kB; empty once the process is gone (a zombie has no Vm* lines)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in keys:
            found[key] = int(value.split()[0])
    return found


def pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (fields 14 and 15 of /proc/<pid>/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent running something since boot: user, nice, system, irq and softirq time
    of /proc/stat (guest time is inside user time already; idle, I/O wait and steal are no work here)."""
    user, nice, system, _idle, _iowait, irq, softirq = (
        int(x) for x in Path("/proc/stat").read_text().split()[1:8]
    )
    return (user + nice + system + irq + softirq) / TICKS


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
