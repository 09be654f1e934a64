"""bench/common.py's `peak_rss_gb` reads the calling process's own peak, not one a child inherits."""
import os
import subprocess
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
import common  # noqa: E402


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmHWM is Linux's")
def test_a_small_child_of_a_large_parent_reads_its_own_peak():
    held = np.ones(300 << 20, dtype=np.uint8)  # 300 MB resident in this process
    parent = common.peak_rss_gb()
    assert parent > 0.3
    code = f"import sys; sys.path.insert(0, {BENCH!r}); import common; print(common.peak_rss_gb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    # a bare interpreter: tens of MB (ru_maxrss there read at least the parent's 0.3 GB)
    assert 0 < child < 0.2 < parent
    del held


def test_off_linux_it_reads_ru_maxrss(monkeypatch):
    import builtins
    import resource

    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: (_ for _ in ()).throw(OSError("no /proc"))
                        if path == "/proc/self/status" else real_open(path, *a, **k))
    monkeypatch.setattr(resource, "getrusage", lambda who: type("R", (), {"ru_maxrss": 123_000})())
    monkeypatch.setattr(sys, "platform", "linux")
    assert common.peak_rss_gb() == 0.123
    monkeypatch.setattr(sys, "platform", "darwin")
    assert common.peak_rss_gb() == 123e-6
