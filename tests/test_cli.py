"""The ``jetrl`` command line: the main job runs and ends with one JSON line; bad input is one line."""

import json
import subprocess
import sys

import pytest

from jetrl.cli import main


@pytest.mark.parametrize("recipe", ["jet", "fp8_rollout"])
def test_train_ends_with_json_line(capsys, recipe):
    assert main(["train", "--recipe", recipe, "--steps", "4"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    assert result["recipe"] == recipe and result["steps"] == 4
    assert result["on_policy"] == (recipe == "jet")
    if recipe == "jet":
        assert result["rollout_abs_diff_mean"] == 0.0
    else:
        assert result["rollout_abs_diff_mean"] > 0.0


def test_bad_arguments_fail_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "jetrl", "train", "--steps", "0"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--steps must be >= 1" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "jetrl", "train", "--recipe", "fp4"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'fp4'" in proc.stderr
