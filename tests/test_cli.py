"""fxmem-plan driven as a user would: subprocess, exit codes, messages, the plan file."""
from __future__ import annotations

import json
import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "fxmem.cli", *args], capture_output=True, text=True, timeout=300)


def test_help_shows_examples():
    result = run("--help")
    assert result.returncode == 0 and "examples:" in result.stdout and "--budget-gb" in result.stdout


def test_list_models():
    result = run("--list-models")
    assert result.returncode == 0 and "gpt-tiny" in result.stdout and "resnet18" in result.stdout


def test_plan_writes_file_and_table(tmp_path):
    out = tmp_path / "plan.json"
    result = run("mlp-tiny", "--budget-gb", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "predicted peak" in result.stdout
    assert json.loads(out.read_text())["model"] == "MLP"


def test_infeasible_budget_is_one_clear_line():
    result = run("mlp-tiny", "--budget-gb", "0.000001", "--time-limit", "5")
    assert result.returncode == 2
    assert "minimum" in result.stderr and "Traceback" not in result.stderr


def test_unknown_model_lists_presets():
    result = run("no-such-model", "--budget-gb", "1")
    assert result.returncode != 0 and "gpt-tiny" in result.stderr and "Traceback" not in result.stderr
