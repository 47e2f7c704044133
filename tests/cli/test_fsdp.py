"""`fxmem-plan MODEL --world-size N`: the rank's table, the plan file, and the flags it refuses."""
from __future__ import annotations

import pytest

from fxmem.cli.main import main
from fxmem.fsdp import FsdpPlan


def test_world_size_table_and_plan(tmp_path, capsys):
    """A budget FSDP2 alone meets: the blocks run eagerly, the table names the shards and the baseline."""
    out = tmp_path / "fsdp.json"
    assert main(["gpt-tiny", "--world-size", "2", "--budget-gb", "1", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for row in ("param shards", "gathered units", "predicted peak per rank", "FSDP2 + full checkpointing"):
        assert row in text
    plan = FsdpPlan.load(out)
    assert plan.world_size == 2 and plan.block_plan is None and plan.predicted_peak_bytes <= plan.budget_bytes
    meta = tmp_path / "meta.json"  # built on the meta device: the rank simulated on fakes is the same
    assert main(["gpt-tiny", "--world-size", "2", "--budget-gb", "1", "--quiet", "--meta", "--out", str(meta)]) == 0
    assert FsdpPlan.load(meta) == plan


@pytest.mark.parametrize("flag", [["--policy", "speed"], ["--stages", "2"]])
def test_world_size_refuses(flag, capsys):
    assert main(["gpt-tiny", "--world-size", "2", "--budget-gb", "1", "--quiet", *flag]) == 2
    assert "--world-size does not combine with" in capsys.readouterr().err
