"""remat-client on trace files: the JSON contracts of the README's CLI reference, bad input on one line with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from remat.client.planning.cost_models import peak
from remat.client.planning.planners import PLANNERS
from remat.client.trace import TRACE_FORMAT
from tests.utils.cli import run_cli

SCRIPT = str(Path(sys.executable).parent / "remat-client")




@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    stages = [{"name": f"s{i}", "output_bytes": d, "saved_bytes": e, "forward_ms": 1.0, "backward_ms": 2.0}
              for i, (d, e) in enumerate([(400, 800), (100, 300), (900, 900), (50, 400), (700, 100), (30, 60)])]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"format": TRACE_FORMAT, "input_bytes": 64, "model": "toy", "stages": stages}))
    return path


class TestPlan:
    def test_single_algorithm_json(self, capsys, trace_file: Path) -> None:
        code, out, _ = run_cli(capsys, "plan", "--trace", str(trace_file), "--algorithm", "cubic", "--json")
        assert code == 0
        plan = json.loads(out)
        assert {"algorithm", "checkpoints", "predicted_peak_bytes", "baseline_peak_bytes",
                "cost_model"} <= set(plan)
        assert plan["algorithm"] == "cubic" and plan["cost_model"] == "classic"
        assert all(1 <= c <= 5 for c in plan["checkpoints"])

    def test_all_algorithms_json_peaks_are_the_models(self, capsys, trace_file: Path) -> None:
        from remat.client.trace import load_trace

        code, out, _ = run_cli(capsys, "plan", "--trace", str(trace_file), "--algorithm", "all",
                               "--cost-model", "pytorch", "--json")
        assert code == 0
        plans = json.loads(out)["plans"]
        assert [p["algorithm"] for p in plans] == list(PLANNERS)
        trace = load_trace(trace_file)
        for p in plans:
            assert p["cost_model"] == "pytorch"
            assert p["predicted_peak_bytes"] == peak(trace, p["checkpoints"], "pytorch")
            assert p["baseline_peak_bytes"] == peak(trace, (), "pytorch")
            assert p["recompute_ms"] == pytest.approx(1.0 * (p["checkpoints"][-1] if p["checkpoints"] else 0))
        by_name = {p["algorithm"]: p for p in plans}
        assert by_name["linear"]["predicted_peak_bytes"] == min(p["predicted_peak_bytes"] for p in plans)

    def test_human_table(self, capsys, trace_file: Path) -> None:
        code, out, _ = run_cli(capsys, "plan", "--trace", str(trace_file))
        assert code == 0
        for word in ("algorithm", "checkpoints", "saving vs none", "linear", "cubic", "chen-greedy"):
            assert word in out

    def test_acg_plans_the_graph_a_trace_carries(self, capsys, trace_file: Path) -> None:
        obj = json.loads(trace_file.read_text())
        # A diamond inside the chain: the input feeds two arms that a join adds.
        obj["graph"] = {"vertices": [{"name": "in", "bytes": 64}, {"name": "a", "bytes": 500},
                                     {"name": "b", "bytes": 500}, {"name": "join", "bytes": 30}],
                        "edges": [[0, 1], [0, 2], [1, 3], [2, 3]]}
        trace_file.write_text(json.dumps(obj))
        code, out, _ = run_cli(capsys, "plan", "--trace", str(trace_file), "--algorithm", "acg", "--json")
        assert code == 0
        plan = json.loads(out)
        assert plan["dropped_vertices"] == [1, 2] and plan["num_vertices"] == 4 and plan["checkpoints"] == []
        assert (plan["cost_model"], plan["predicted_peak_bytes"], plan["baseline_peak_bytes"]) == ("classic", 500, 1000)
        code, out, _ = run_cli(capsys, "plan", "--trace", str(trace_file), "--algorithm", "acg")
        assert code == 0 and "graph: recomputes 2 of 4 vertices" in out

    def test_a_bad_graph_is_named_in_one_line(self, capsys, trace_file: Path) -> None:
        obj = json.loads(trace_file.read_text())
        obj["graph"] = {"vertices": [{"name": "in", "bytes": 64}, {"name": "out", "bytes": 8}], "edges": [[1, 0]]}
        trace_file.write_text(json.dumps(obj))
        code, _, err = run_cli(capsys, "plan", "--trace", str(trace_file), "--algorithm", "acg")
        assert code == 2
        assert "graph.edges[0]: [1, 0] must satisfy" in err and err.count("\n") <= 1


class TestEvaluate:
    def test_peaks_in_file_order(self, capsys, trace_file: Path, tmp_path: Path) -> None:
        sets = tmp_path / "sets.txt"
        sets.write_text("\n2\n1,3\n 2 , 4 \n")
        code, out, _ = run_cli(capsys, "evaluate", "--trace", str(trace_file), "--cost-model", "classic",
                               "--checkpoints-file", str(sets), "--json")
        assert code == 0
        from remat.client.trace import load_trace

        trace = load_trace(trace_file)
        expected = [peak(trace, s, "classic") for s in [(), (2,), (1, 3), (2, 4)]]
        assert json.loads(out)["peaks"] == expected


BAD_TRACES = {
    "not json": ("{nope", "not valid JSON"),
    "wrong format": (json.dumps({"format": "x", "input_bytes": 1, "stages": []}), "format: must be"),
    "zero stages": (json.dumps({"format": TRACE_FORMAT, "input_bytes": 1, "stages": []}), "at least one stage"),
    "negative size": (json.dumps({"format": TRACE_FORMAT, "input_bytes": 1,
                                  "stages": [{"name": "a", "output_bytes": -5, "saved_bytes": 1}]}),
                      "stages[0].output_bytes: must be ≥ 0"),
    "non-integer": (json.dumps({"format": TRACE_FORMAT, "input_bytes": 1,
                                "stages": [{"name": "a", "output_bytes": 1, "saved_bytes": "9"}]}),
                    "stages[0].saved_bytes: must be an integer"),
    "missing size": (json.dumps({"format": TRACE_FORMAT, "input_bytes": 1,
                                 "stages": [{"name": "a", "saved_bytes": 1}]}), "stages[0].output_bytes: missing"),
}


@pytest.mark.parametrize("case", list(BAD_TRACES))
@pytest.mark.parametrize("command", ["plan", "evaluate"])
def test_bad_trace_exits_2_with_one_line(capsys, tmp_path: Path, case: str, command: str) -> None:
    text, message = BAD_TRACES[case]
    path = tmp_path / "bad.json"
    path.write_text(text)
    sets = tmp_path / "sets.txt"
    sets.write_text("\n")
    args = ["plan", "--trace", str(path)] if command == "plan" else [
        "evaluate", "--trace", str(path), "--cost-model", "pytorch", "--checkpoints-file", str(sets)]
    code, out, err = run_cli(capsys, *args, "--json")
    assert code == 2
    assert out == ""
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(("args", "message"), [
    (["plan", "--trace", "{trace}", "--algorithm", "magic"], "--algorithm: 'magic' is unknown"),
    (["plan", "--trace", "{trace}", "--cost-model", "magic"], "'magic' is not one of"),
    (["plan"], "give a zoo MODEL or --trace FILE"),
    (["plan", "--trace", "{missing}"], "cannot be read"),
    (["evaluate", "--trace", "{trace}", "--cost-model", "pytorch", "--checkpoints-file", "{sets}"],
     "{sets}:2: checkpoints: boundary 9 is not in 1..5"),
    (["evaluate", "--trace", "{trace}", "--cost-model", "pytorch", "--checkpoints-file", "{words}"],
     "{words}:1: 'a,b' is not a comma-separated list of integers"),
    (["evaluate", "--trace", "{trace}", "--checkpoints-file", "{sets}"], "Missing option '--cost-model'"),
    (["frobnicate"], "No such command"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, tmp_path: Path, trace_file: Path, args: list[str],
                                            message: str) -> None:
    (tmp_path / "sets.txt").write_text("1\n9\n")
    (tmp_path / "words.txt").write_text("a,b\n")
    names = {"trace": str(trace_file), "missing": str(tmp_path / "none.json"),
             "sets": str(tmp_path / "sets.txt"), "words": str(tmp_path / "words.txt")}
    code, _, err = run_cli(capsys, *[a.format(**names) for a in args])
    assert code == 2
    assert message.format(**names) in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_trace_planning_never_imports_torch(trace_file: Path) -> None:
    """The installed script plans from a trace without loading torch (it must start in well under 1 s)."""
    probe = (
        "import sys\n"
        "from remat.client.cli import main\n"
        "try:\n"
        f"    main(['plan', '--trace', {str(trace_file)!r}, '--algorithm', 'all', '--json'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "heavy = sorted(m for m in ('torch', 'sqlalchemy', 'celery', 'fastapi') if m in sys.modules)\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "HEAVY []" in result.stderr


def test_installed_script_runs(trace_file: Path) -> None:
    result = subprocess.run([SCRIPT, "plan", "--trace", str(trace_file), "--algorithm", "linear", "--json"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["algorithm"] == "linear"
