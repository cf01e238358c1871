"""The private MPS daemon around a study's workers, against a stand-in control program (a shell script
on PATH that records how it was called and makes the control pipe as the real one does)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nnrand import mps, study

FAKE = """#!/bin/sh
echo "$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "{log}"
if [ "$1" = "-d" ]; then
    [ -n "{fail}" ] && {{ echo "cannot start: {fail}" >&2; exit 3; }}
    [ -n "{nopipe}" ] || mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"
    [ -n "{linger}" ] && {{ sleep 30 & }}   # a forked child that keeps the inherited output open
    exit 0
fi
cat >> "{log}"
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    def make(fail: str = "", nopipe: str = "", linger: str = "") -> Path:
        bindir = tmp_path / "bin"
        bindir.mkdir(exist_ok=True)
        log = tmp_path / "calls.log"
        exe = bindir / mps.CONTROL
        exe.write_text(FAKE.format(log=log, fail=fail, nopipe=nopipe, linger=linger))
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
        for var in mps.ENV:
            monkeypatch.delenv(var, raising=False)
        return log
    return make


def test_daemon_starts_private_pipe_children_inherit_and_quit_on_exit(fake_control):
    log = fake_control()
    with mps.daemon() as pipe:
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe) and (pipe / "control").exists()
        child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['CUDA_MPS_PIPE_DIRECTORY'])"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == str(pipe)   # a process started inside is a client of this daemon
    assert not any(v in os.environ for v in mps.ENV)
    assert not pipe.exists()
    calls = log.read_text().splitlines()
    assert calls[0] == f"-d pipe={pipe} log={pipe.parent / 'log'}"
    assert calls[1] == f" pipe={pipe} log={pipe.parent / 'log'}" and calls[2] == "quit"


def test_start_returns_while_the_forked_daemon_holds_its_output(fake_control):
    # read through a pipe, the start would wait for the child's 30 s and hit the start timeout; 20 s is well
    # below that and leaves a loaded machine time to start the fake control script
    fake_control(linger="1")
    with mps.daemon(start_timeout_s=20.0) as pipe:
        assert (pipe / "control").exists()


def test_pipe_directory_stays_short_under_a_long_tmpdir(fake_control, monkeypatch, tmp_path):
    long_tmp = tmp_path / ("t" * 80)
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    fake_control()
    with mps.daemon() as pipe:
        assert len(str(pipe / "control")) < 100 and not str(pipe).startswith(str(long_tmp))


def test_daemon_quits_when_the_block_raises(fake_control):
    log = fake_control()
    with pytest.raises(KeyboardInterrupt):
        with mps.daemon():
            raise KeyboardInterrupt
    assert log.read_text().splitlines()[-1] == "quit" and not any(v in os.environ for v in mps.ENV)


def test_daemon_errors_name_the_cause(fake_control, monkeypatch, tmp_path):
    fake_control(fail="no GPU")
    with pytest.raises(mps.MPSError, match=r"-d failed \(exit 3\): cannot start: no GPU"):
        with mps.daemon():
            pass
    fake_control(nopipe="1")
    with pytest.raises(mps.MPSError, match="made no control pipe"):
        with mps.daemon(start_timeout_s=0.2):
            pass
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/somewhere")
    with pytest.raises(mps.MPSError, match="already set"):
        with mps.daemon():
            pass
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(mps.MPSError, match="not found on PATH"):
        with mps.daemon():
            pass


def test_study_refuses_mps_without_cuda_workers(capsys):
    with pytest.raises(SystemExit) as e:
        study.cli(["--device", "cpu", "--smoke", "--configs", "control", "--mps", "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--mps" in err and "(here: cpu, 1 job)" in err


# probes: a stand-in client that reports the pipe it was given, or fails as a refused CUDA client would
SEES_PIPE = (sys.executable, "-c", "import os, pathlib; pathlib.Path(os.environ['PROBE_OUT']).write_text("
                                   "os.environ['CUDA_MPS_PIPE_DIRECTORY'])")
REFUSED = (sys.executable, "-c", "raise SystemExit('RuntimeError: all CUDA-capable devices are busy or unavailable')")


def test_probe_runs_as_a_client_before_the_block(fake_control, monkeypatch, tmp_path):
    fake_control()
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "probe.txt"))
    with mps.daemon(probe=SEES_PIPE) as pipe:
        assert (tmp_path / "probe.txt").read_text() == str(pipe)


def test_refused_probe_stops_the_daemon_and_names_the_client_error(fake_control):
    log = fake_control()
    with pytest.raises(mps.MPSError, match=r"a client of the daemon failed \(exit 1\): RuntimeError: all CUDA"):
        with mps.daemon(probe=REFUSED):
            pytest.fail("the block must not run when the probe fails")
    assert log.read_text().splitlines()[-1] == "quit" and not any(v in os.environ for v in mps.ENV)


def test_study_uses_mps_by_default_and_runs_without_it_when_it_cannot(fake_control, capsys):
    log = fake_control()
    with study.worker_mps(None, probe=(sys.executable, "-c", "pass")):
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        assert "under a private CUDA MPS daemon" in capsys.readouterr().err
    assert log.read_text().splitlines()[-1] == "quit" and not Path(pipe).exists()

    with study.worker_mps(None, probe=REFUSED):        # default: a note, then the run goes on without
        assert not any(v in os.environ for v in mps.ENV)
    assert "workers without MPS (they take turns on the GPU): a client of the daemon failed" in capsys.readouterr().err
    with pytest.raises(mps.MPSError, match="a client of the daemon failed"):    # --mps: an error
        study.worker_mps(True, probe=REFUSED)

    calls = len(log.read_text().splitlines())
    with study.worker_mps(False):                        # --no-mps, or no CUDA workers: nothing started
        assert not any(v in os.environ for v in mps.ENV)
    assert len(log.read_text().splitlines()) == calls and capsys.readouterr().err == ""


def test_study_leaves_mps_to_a_daemon_configured_outside(fake_control, monkeypatch, capsys):
    log = fake_control()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/srv/mps")
    with study.worker_mps(None):
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == "/srv/mps"
    assert "the MPS daemon that CUDA_MPS_PIPE_DIRECTORY names (/srv/mps)" in capsys.readouterr().err
    assert not log.exists()
    with pytest.raises(mps.MPSError, match="already set"):
        study.worker_mps(True)
