"""Peak anonymous memory of this process while a block runs (Linux), for the
benchmarks in this folder (``from memwatch import PeakSampler`` works because
a script's own folder is on its import path)."""
from __future__ import annotations

import threading
import time


def rss_anon_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class PeakSampler:
    """Highest RssAnon seen while active, in kB (sampled every ``interval`` s)."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, rss_anon_kb())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakSampler":
        self.peak_kb = rss_anon_kb()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kb = max(self.peak_kb, rss_anon_kb())
