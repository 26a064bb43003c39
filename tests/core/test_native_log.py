"""core.native_log: TVM's C++ lines go to the log, Python's prints and warnings still reach the terminal."""
import logging
import os
import sys

import tvmdm
from tvmdm.core import native_log


def test_native_writes_go_to_the_log_and_python_still_prints(capfd, caplog, tmp_path):
    log_file = tmp_path / "logs" / "native.log"
    with caplog.at_level(logging.DEBUG, logger="tvmdm.tvm"):
        with native_log.to_log(str(log_file)):
            os.write(2, b"[12:00:00] codegen_cpu.cc:1183: Warning: Unknown pragma\n")  # as TVM's C++ writes
            os.write(1, b"TIR of a MetaSchedule task\n")
            print("progress on stdout", flush=True)
            print("progress on stderr", file=sys.stderr, flush=True)  # and Python's warnings, which write there
    out, err = capfd.readouterr()
    assert "Unknown pragma" not in err and "TIR of a" not in out
    assert "progress on stdout" in out and "progress on stderr" in err
    assert log_file.read_text() == "[12:00:00] codegen_cpu.cc:1183: Warning: Unknown pragma\nTIR of a MetaSchedule task\n"
    assert [r.getMessage() for r in caplog.records if r.name == "tvmdm.tvm"] == [
        "[12:00:00] codegen_cpu.cc:1183: Warning: Unknown pragma", "TIR of a MetaSchedule task"]
    os.write(2, b"after\n")  # the descriptors are back
    assert capfd.readouterr().err == "after\n"


def test_verbose_lets_tvm_write_where_it_writes(capfd, monkeypatch):
    monkeypatch.setenv("TVMDM_VERBOSE", "1")
    with native_log.to_log():
        os.write(2, b"shown as written\n")
    assert capfd.readouterr().err == "shown as written\n"


def test_a_training_compile_prints_nothing_of_tvms_own(capfd):
    """It used to print LLVM's "Unknown pragma pragma_scope" per kernel and TOPI's take warnings."""
    tvmdm.compile_train_step(tvmdm.default_model("bert-small"), loss="mse", batch=2, seq=4, tuning_logs=None)
    out, err = capfd.readouterr()
    assert "Warning" not in err and "pragma" not in err and out == ""
