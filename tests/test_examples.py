"""The examples run as the README says and do what they claim."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from harness import HERE

pytest.importorskip("torch", reason="the torch extra is not installed")
pytest.importorskip("sklearn", reason="scikit-learn (the examples extra) is not installed")

EXAMPLES = HERE.parent / "examples"


def _totalrun(n: int, *args: str, timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOTALREDUCE_")}
    proc = subprocess.run([sys.executable, "-m", "totalreduce.run", "-np", str(n),
                           sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("n", [1, 2, 4])
def test_digits_reaches_95_percent_in_20_epochs(n: int) -> None:
    out = _totalrun(n, str(EXAMPLES / "train_digits.py"), "--epochs", "20", timeout=150)
    found = re.search(r"final test accuracy ([\d.]+)%", out)
    assert found and float(found.group(1)) >= 95.0, out[-2000:]
