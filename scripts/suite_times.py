#!/usr/bin/env python
"""Where the test suite's time goes: a pytest plugin that logs, per test, its CPU seconds (this process
and its children), wall seconds, and the wall seconds spent in CP-SAT solves, those stopped by their
time limit apart; and a summary of such logs per file and per test.

CPU seconds stay steady on a loaded machine, where wall seconds do not; a CP-SAT solve stopped by its
time limit takes that limit in wall seconds on any machine (two threads of it: `num_workers=2`), so
the at-limit column is the time lower limits would save. Reads nothing of the project; writes the log
(`SUITE_TIMES`, default suite_times.tsv) and prints the summary.

examples:
  PYTHONPATH=scripts pytest -n 0 -p suite_times tests/test_api.py     # appends to suite_times.tsv
  python scripts/suite_times.py suite_times.tsv                        # per file, then the slowest tests
"""
from __future__ import annotations

import collections
import os
import sys
import time

_LOG = os.environ.get("SUITE_TIMES", "suite_times.tsv")
_started: dict[str, float] = {}  # CPU and wall seconds at the test's start; "on": this process logs
_solves = {"n": 0, "all": 0.0, "limit": 0.0}
_DONE = ("OPTIMAL", "INFEASIBLE", "MODEL_INVALID")


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def pytest_configure(config) -> None:
    # under xdist the controller sees every test's start and finish too: only the workers log
    _started["on"] = hasattr(config, "workerinput") or not config.getoption("numprocesses", None)
    from ortools.sat.python import cp_model

    solve = cp_model.CpSolver.solve

    def timed(self, *args, **kwargs):
        started = time.perf_counter()
        status = solve(self, *args, **kwargs)
        seconds = time.perf_counter() - started
        _solves["n"] += 1
        _solves["all"] += seconds
        if self.status_name(status) not in _DONE:
            _solves["limit"] += seconds
        return status

    cp_model.CpSolver.solve = cp_model.CpSolver.Solve = timed


def pytest_runtest_logstart(nodeid, location) -> None:
    _started.update(cpu=_cpu(), wall=time.perf_counter())
    _solves.update(n=0, all=0.0, limit=0.0)


def pytest_runtest_logfinish(nodeid, location) -> None:
    if not _started.get("on", True):
        return
    cpu, wall = _cpu() - _started["cpu"], time.perf_counter() - _started["wall"]
    with open(_LOG, "a") as f:
        f.write(f"{nodeid}\t{cpu:.2f}\t{wall:.2f}\t{_solves['n']}\t{_solves['all']:.2f}\t{_solves['limit']:.2f}\n")


def summary(paths: list[str], top: int = 40) -> str:
    rows = [line.rstrip("\n").split("\t") for path in paths for line in open(path) if line.strip()]
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0, 0.0])
    for node, cpu, _, _, _, limit in rows:
        entry = files[node.split("::")[0]]
        entry[0] += float(cpu)
        entry[2] += 1
        entry[3] += float(limit)
    out = [f"{len(rows)} tests, {sum(f[0] for f in files.values()):.0f} s CPU, "
           f"{sum(f[3] for f in files.values()):.0f} s in CP-SAT solves stopped by their time limit",
           "file\tCPU s\ttests\tCP-SAT at limit s"]
    out += [f"{name}\t{f[0]:.0f}\t{f[2]}\t{f[3]:.0f}" for name, f in sorted(files.items(), key=lambda kv: -kv[1][0])]
    out += ["", "test\tCPU s\tCP-SAT at limit s"]
    out += [f"{r[0]}\t{float(r[1]):.1f}\t{float(r[5]):.1f}" for r in sorted(rows, key=lambda r: -float(r[1]))[:top]]
    return "\n".join(out)


if __name__ == "__main__":
    print(summary(sys.argv[1:] or [_LOG]))
