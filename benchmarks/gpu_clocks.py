"""The GPU's SM clock and power while a benchmark runs: nvidia-smi sampled in the background, read back by
time window (GPU machines; without nvidia-smi every reading is empty)."""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

FIELDS = ("clocks.sm", "power.draw.instant", "power.draw")


def parse_line(line: str):
    """(unix time, SM MHz, W) of one ``timestamp, clocks.sm, power...`` CSV line (the first power field
    that reads as a number), or None."""
    parts = [x.strip() for x in line.split(",")]
    if len(parts) < 3 or "." not in parts[0]:
        return None
    stamp, frac = parts[0].rsplit(".", 1)
    try:
        when = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
        mhz = float(parts[1])
    except ValueError:
        return None
    for field in parts[2:]:
        try:
            return when, mhz, float(field)
        except ValueError:
            continue
    return None


def window_stats(samples, windows) -> dict:
    """Median MHz and W of the samples inside any of ``windows`` ((start, end) unix times), and their count."""
    inside = [(mhz, w) for t, mhz, w in samples if any(a <= t <= b for a, b in windows)]
    if not inside:
        return {}
    return {
        "mhz": statistics.median(m for m, _ in inside),
        "watts": statistics.median(w for _, w in inside),
        "samples": len(inside),
    }


class ClockSampler:
    """``nvidia-smi`` every ``period_ms`` on GPU ``index`` into a temporary file; a context manager whose
    :meth:`samples` are read after it exits."""

    def __init__(self, index: int = 0, period_ms: int = 20):
        self.index, self.period_ms, self.proc, self.log = index, period_ms, None, None

    def __enter__(self):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return self
        fields = ",".join(("timestamp",) + FIELDS)
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
        probe = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits"], capture_output=True)
        if probe.returncode != 0:  # a driver without power.draw.instant
            fields = fields.replace(",power.draw.instant", "")
        self.proc = subprocess.Popen(
            [exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", str(self.period_ms)]
            + ["-i", str(self.index)],
            stdout=self.log,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.3)  # its first sample
        return self

    def samples(self) -> list:
        """[(unix time, SM MHz, W)] so far."""
        if self.log is None:
            return []
        self.log.flush()
        return [s for s in map(parse_line, Path(self.log.name).read_text().splitlines()) if s is not None]

    def __exit__(self, *exc):
        if self.proc is not None:  # Ctrl-C ends its loop cleanly, its output flushed; read samples() after this
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return False
