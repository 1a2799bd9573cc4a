"""GPU energy from NVML's cumulative energy counter (millijoules since driver load)."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class EnergyMeter:
    """``with meter: work`` then ``meter.joules``/``meter.seconds``; ``available`` is False without NVML."""

    def __init__(self, device_index: int = 0) -> None:
        self.available = False
        self.joules = float("nan")
        self.seconds = float("nan")
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            self.available = True
        except Exception as exc:  # no NVML, no GPU, or counter unsupported
            log.info("NVML energy counter unavailable: %s", exc)

    def _millijoules(self) -> int:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)

    def idle_watts(self, seconds: float = 1.0) -> float:
        """Average power over ``seconds`` with nothing running (the caller makes sure of that)."""
        if not self.available:
            return float("nan")
        e0, t0 = self._millijoules(), time.perf_counter()
        time.sleep(seconds)
        return (self._millijoules() - e0) / 1e3 / (time.perf_counter() - t0)

    def __enter__(self) -> EnergyMeter:
        if self.available:
            self._e0, self._t0 = self._millijoules(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.available:
            self.joules = (self._millijoules() - self._e0) / 1e3
            self.seconds = time.perf_counter() - self._t0
