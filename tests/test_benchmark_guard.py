"""benchmarks/quiet.py: a benchmark refuses a busy machine (load average above 0.5 or another process on a core)
and, with --allow-busy, marks every table row "busy"."""

import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import quiet  # noqa: E402


@pytest.fixture
def machine(monkeypatch):
    state = {"load": 0.1, "others": []}
    monkeypatch.setattr(quiet, "load_average", lambda: state["load"])
    monkeypatch.setattr(quiet, "busy_processes", lambda: state["others"])
    monkeypatch.setattr(quiet, "BUSY", False)
    monkeypatch.setattr(quiet, "dot_peak", lambda: 5e11)
    return state


def test_quiet_machine_runs_unmarked(machine, capsys):
    argv = ["bench.py", "--repeats", "3"]
    assert quiet.guard(argv) is False and argv == ["bench.py", "--repeats", "3"]
    assert "dot peak 500 GFLOP/s" in capsys.readouterr().out


@pytest.mark.parametrize("load, others", [(0.8, []), (0.1, [(42, "python", 0.9)])])
def test_busy_machine_refused(machine, capsys, load, others):
    machine.update(load=load, others=others)
    with pytest.raises(SystemExit) as stop:
        quiet.guard(["bench.py"])
    assert stop.value.code == 3
    err = capsys.readouterr().err
    assert f"load average {load:.2f}" in err and "--allow-busy" in err
    assert all(f"pid {pid}" in err for pid, _, _ in others)


def test_allowed_busy_machine_marks_every_row(machine, monkeypatch):
    machine.update(load=3.0)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    argv = ["bench.py", "--allow-busy", "--repeats", "1"]
    assert quiet.guard(argv) is True and argv == ["bench.py", "--repeats", "1"] and quiet.BUSY
    print("heading\n| figure | ratio |\n| --- | --- |\n| forward | 1.5x |")
    sys.stdout.flush()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("BUSY") and "3.00" in lines[0] and "500 GFLOP/s" in lines[0]
    assert lines[1:] == ["heading", "| busy: figure | ratio |", "| --- | --- |", "| busy: forward | 1.5x |"]


def test_the_benchmarks_own_processes_are_not_others():
    """A benchmark's ancestors (its shell) and descendants (its measuring subprocesses) are its own; a sibling's
    child is another process."""
    ticks = {1: (0, 0, "init"), 10: (0, 1, "shell"), 11: (0, 10, "bench"), 12: (0, 11, "child"), 13: (0, 12, "grand"),
             20: (0, 10, "sibling"), 21: (0, 20, "other")}
    assert quiet._family(ticks, 11) == {1, 10, 11, 12, 13}
