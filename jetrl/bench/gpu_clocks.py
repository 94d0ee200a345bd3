"""The GPU's SM clock and power draw while a timed phase runs, sampled by ``nvidia-smi`` in the background.

Why: a sustained decode of the 8B at batch 256 draws the H200 to its 700 W power limit, and the driver then lowers
the SM clock (to 1560-1850 MHz from 1980 in run GA, docs/benchmarks.md (e)), while a short burst of graph replays
-- section (d)'s decode step -- runs at the full clock. A rollout's ms per step therefore sits above (d)'s step for
a reason that is the board's, not the code's, and differs between recipes (FP8 draws less per step, so its clock
drops less). Every rollout row carries what the clock and power were while it ran, so a reader can tell.

    with ClockLog(device) as log:
        run()
    log.summary()   # {"sm_mhz_mean": ..., "sm_mhz_min": ..., "power_w_mean": ..., "power_capped": ...} or {}

``power_capped`` is the fraction of samples whose active clock-event reasons include the software power cap
(bit 0x4 of ``clocks_throttle_reasons.active``). Without a CUDA device or without ``nvidia-smi`` the log is empty:
the bench never fails for want of it.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any, Self

import torch

QUERY = "uuid,clocks.sm,power.draw,clocks_throttle_reasons.active"
SW_POWER_CAP = 0x4
INTERVAL_MS = 200


def parse_samples(text: str, uuid: str | None = None) -> list[tuple[float, float, int]]:
    """(SM MHz, watts, reason bits) per line of ``nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits``
    output, of the GPU whose UUID is ``uuid`` (any GPU's if None); lines that do not parse (a header, a truncated
    last line, "[N/A]") are skipped."""
    want = None if uuid is None else _bare(uuid)
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or (want is not None and _bare(parts[0]) != want):
            continue
        try:
            samples.append((float(parts[1]), float(parts[2]), int(parts[3], 16)))
        except ValueError:
            continue
    return samples


def _bare(uuid: str) -> str:
    """A GPU UUID without nvidia-smi's "GPU-" prefix, lower case (torch prints it bare)."""
    return str(uuid).strip().lower().removeprefix("gpu-")


def summarize(samples: list[tuple[float, float, int]]) -> dict[str, Any]:
    if not samples:
        return {}
    clocks, watts = [s[0] for s in samples], [s[1] for s in samples]
    return {"sm_mhz_mean": round(sum(clocks) / len(clocks)), "sm_mhz_min": round(min(clocks)),
            "power_w_mean": round(sum(watts) / len(watts)),
            "power_capped": round(sum(1 for s in samples if s[2] & SW_POWER_CAP) / len(samples), 2),
            "samples": len(samples)}


class ClockLog:
    """Context manager: ``nvidia-smi`` samples the device every INTERVAL_MS while the block runs (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.proc: subprocess.Popen | None = None
        self.uuid: str | None = None
        self.text = ""

    def _command(self) -> list[str] | None:
        exe = shutil.which("nvidia-smi")
        if self.device.type != "cuda" or exe is None:
            return None
        # every GPU is sampled and the lines of the one torch runs on kept (by UUID): nvidia-smi's numbering need
        # not be torch's under CUDA_VISIBLE_DEVICES
        uuid = getattr(torch.cuda.get_device_properties(self.device), "uuid", None)
        self.uuid = None if uuid is None else str(uuid)
        return [exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", f"--loop-ms={INTERVAL_MS}"]

    def __enter__(self) -> Self:
        command = self._command()
        if command is not None:
            try:
                self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self.proc = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.text, _ = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.text, _ = self.proc.communicate()

    def summary(self) -> dict[str, Any]:
        return summarize(parse_samples(self.text, self.uuid))
