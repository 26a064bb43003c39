"""Fuzzing, seeded and bounded: mutated models (truncated, bit-flipped, dims and attributes changed,
initializers cut short), mutated run inputs and mutated artifacts. Each case must end in a tvmdm error or
onnxruntime's answer: never a signal, a hang, another exception or a silent difference (tests/helpers/fuzz.py
runs the cases in a child process and classifies each)."""
import collections
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("kind, count", [("models", 120), ("inputs", 60), ("artifacts", 40)])
def test_every_mutant_gets_a_tvmdm_error_or_onnxruntimes_answer(tmp_path, kind, count):
    out = tmp_path / f"{kind}.jsonl"
    done = subprocess.run([sys.executable, "-m", "tests.helpers.fuzz", kind, str(out), "0", str(count)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    entries = [json.loads(line) for line in out.read_text().splitlines()]
    started = [e for e in entries if "start" in e]
    assert done.returncode == 0, (f"the child ended with {done.returncode} in case {started[-1] if started else None}"
                                  f": {done.stderr[-2000:]}")
    assert entries[-1] == {"done": True}
    results = [e for e in entries if "outcome" in e]
    assert len(results) == len(started) == count + 1
    wrong = [e for e in results if e["outcome"] not in ("tvmdm_error", "same")]
    assert not wrong, json.dumps(wrong, indent=1)[:4000]
    assert results[0]["kind"] == "intact" and results[0]["outcome"] == "same"  # the comparison itself works
    outcomes = collections.Counter(e["outcome"] for e in results)
    assert outcomes["tvmdm_error"] >= count // 4, outcomes  # the mutants did reach the checks
