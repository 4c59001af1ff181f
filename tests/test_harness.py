"""The harness's own guarantees: its leak check sees what it must."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import _our_processes


def test_leak_check_sees_a_process_started_by_a_test_even_below_a_shell() -> None:
    proc = subprocess.Popen(["bash", "-c", f"{sys.executable} -c 'import time; "
                             "time.sleep(60)' & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(_our_processes()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = _our_processes()
        assert proc.pid in found and len(found) >= 2, found
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)], check=False)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while _our_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
