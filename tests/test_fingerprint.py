"""Environment fingerprints: the run view and the result-row view of the same queries; NNRAND_GIT_SHA names
the commit of a copied tree."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from bench import results
from nnrand import fingerprint as fp


@pytest.fixture
def fresh_git():
    """The git query is cached per process: clear it around a test that changes NNRAND_GIT_SHA."""
    fp._git.cache_clear()
    yield
    fp._git.cache_clear()


def test_git_sha_override(monkeypatch, fresh_git):
    monkeypatch.setenv("NNRAND_GIT_SHA", "abc123def456")
    assert fp._git() == {"git_sha": "abc123def456", "git_dirty": None, "git_edits": None}
    assert fp.git_sha() == "abc123def456"
    assert fp.fingerprint()["git_sha"] == "abc123def456"


def test_git_sha_from_the_checkout(monkeypatch, fresh_git):
    monkeypatch.delenv("NNRAND_GIT_SHA", raising=False)
    sha = fp._git()["git_sha"]
    short = fp.git_sha()
    if sha is None:  # no git here
        assert short == "unknown"
    else:
        assert re.fullmatch(r"[0-9a-f]{40}", sha)
        assert re.fullmatch(re.escape(sha[:12]) + r"(-dirty-[0-9a-f]{8})?", short), short


def test_row_fingerprint_is_the_result_columns():
    row = fp.row_fingerprint()
    assert tuple(row) == fp.FIELDS
    assert all(isinstance(v, str) and v for v in row.values()), row
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", row["date"])
    assert row["torch"] == torch.__version__
    assert results.COLUMNS[-len(fp.FIELDS):] == list(fp.FIELDS)
    if not torch.cuda.is_available():
        assert row["gpu"] == row["driver"] == row["cudnn"] == "none"


def test_run_fingerprint_cpu():
    info = fp.fingerprint("cpu")
    for key in ("gpu", "driver", "cuda", "cudnn", "torch", "cupy", "numba", "numpy", "cpu", "git_sha", "git_dirty",
                "date", "device", "cpu_threads"):
        assert key in info, key
    assert info["device"] == "cpu" and info["gpu"] is None and info["driver"] is None
    assert info["cpu_threads"] == torch.get_num_threads()


# --------------------------------------------------------------------------------------------------
# What a dirty SHA names, in a repository of its own


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
                        "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z", "HOME": str(repo), "PATH": "/usr/bin:/bin"})


@pytest.fixture
def repo(tmp_path, monkeypatch, fresh_git):
    """A committed checkout with kernels/ and reports/, standing in for the project's (fp.REPO)."""
    if shutil.which("git") is None:
        pytest.skip("no git here")
    monkeypatch.delenv("NNRAND_GIT_SHA", raising=False)
    for path, text in (("kernels/sum.py", "x = 1\n"), ("kernels/sum.cu", "// sum\n"), ("reports/r.md", "r\n"),
                       ("README.md", "readme\n")):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "base")
    monkeypatch.setattr(fp, "REPO", tmp_path)
    return tmp_path


def _sha() -> str:
    fp._git.cache_clear()
    return fp.git_sha()


def test_dirty_sha_names_its_edits(repo):
    clean = _sha()
    assert re.fullmatch(r"[0-9a-f]{12}", clean)
    # a result or report the run itself writes does not make the tree another one (its resume would not match)
    (repo / "reports" / "r.md").write_text("rendered again\n")
    (repo / "reports" / "results.csv").write_text("a,b\n")
    assert _sha() == clean
    # an untracked kernel pair is imported by kernels/__init__.py: it counts, and its content is named
    (repo / "kernels" / "new_op.py").write_text("y = 2\n")
    one = _sha()
    assert re.fullmatch(re.escape(clean) + r"-dirty-[0-9a-f]{8}", one), one
    (repo / "kernels" / "new_op.py").write_text("y = 3\n")
    two = _sha()
    assert two != one and two.startswith(clean + "-dirty-")
    (repo / "kernels" / "new_op.py").unlink()
    # an untracked file elsewhere is not code the package imports
    (repo / "notes.txt").write_text("n\n")
    assert _sha() == clean
    # edits of tracked files: each edit its own name, the same edit the same name
    (repo / "kernels" / "sum.py").write_text("x = 2\n")
    a = _sha()
    (repo / "kernels" / "sum.py").write_text("x = 3\n")
    b = _sha()
    (repo / "kernels" / "sum.py").write_text("x = 2\n")
    assert a != b and _sha() == a and a.startswith(clean + "-dirty-")
    info = fp.fingerprint()
    assert info["git_dirty"] is True and a.endswith(info["git_edits"])


def test_dirty_sha_ignores_the_users_git_configuration(repo, monkeypatch):
    """The edits are named from git's plumbing: an external diff tool (which would print nothing, and so
    call an edited tree clean), prefixes, abbreviations, context, colour and rename detection do not change
    the name; a file touched without a change is no edit."""
    (repo / "kernels" / "sum.py").write_text("x = 4\n")
    plain = _sha()
    assert "-dirty-" in plain
    monkeypatch.setenv("GIT_EXTERNAL_DIFF", "true")
    monkeypatch.setenv("GIT_CONFIG_PARAMETERS", "'diff.noprefix=true' 'core.abbrev=12' 'diff.context=5' "
                                                "'color.diff=always' 'diff.renames=false' 'diff.mnemonicPrefix=true'")
    assert _sha() == plain
    monkeypatch.delenv("GIT_EXTERNAL_DIFF")
    monkeypatch.delenv("GIT_CONFIG_PARAMETERS")
    subprocess.run(["git", "checkout", "-q", "--", "kernels/sum.py"], cwd=repo, check=True)
    clean = _sha()
    assert "-dirty" not in clean
    os.utime(repo / "kernels" / "sum.py", (1, 1))   # touched, not changed
    assert _sha() == clean


def test_no_git_cupy_or_nvidia_smi_is_no_crash(monkeypatch, fresh_git):
    """Without git, nvidia-smi or CuPy every field is still a string: "unknown" or "absent"."""
    monkeypatch.delenv("NNRAND_GIT_SHA", raising=False)
    monkeypatch.setattr(fp, "_run", lambda cmd: None)
    monkeypatch.setattr(fp, "_run_bytes", lambda cmd: None)
    monkeypatch.setitem(sys.modules, "cupy", None)   # import cupy raises ImportError
    fp._row_static.cache_clear()
    try:
        row = fp.row_fingerprint()
        assert row["git_sha"] == "unknown" and row["cupy"] == row["nvrtc"] == row["cupy_cuda"] == "absent"
        assert all(isinstance(v, str) and v for v in row.values()), row
        info = fp.fingerprint("cpu")
        assert info["git_sha"] is None and info["cupy"] is None
    finally:
        fp._row_static.cache_clear()


def test_cpu_capability_is_recorded():
    """torch's CPU kernels dispatch on the instruction set (AVX2, AVX512, ...): it changes CPU results."""
    want = torch.backends.cpu.get_cpu_capability()
    assert fp.row_fingerprint()["cpu_capability"] == want and fp.fingerprint("cpu")["cpu_capability"] == want


def test_old_result_tables_still_read(tmp_path):
    """A table written before the fingerprint's newer fields (nvrtc, cupy_cuda, cpu_capability) reads and
    frames with those columns filled in."""
    old_fields = [f for f in fp.FIELDS if f not in ("nvrtc", "cupy_cuda", "cpu_capability")]
    row = {c: "" for c in results.KEY_COLUMNS} | {"op": "sum", "variant": "tree", "metric": "latency",
                                                   "value": 1.5e-6, "repeats": 3}
    row |= {f: "x" for f in old_fields}
    path = tmp_path / "old.csv"
    path.write_text(",".join(list(row)) + "\n" + ",".join(str(v) for v in row.values()) + "\n")
    df = results.frame(results.read(path).to_dict("records"))
    assert list(df.columns) == results.COLUMNS
    assert df.loc[0, "cpu_capability"] == "" and df.loc[0, "value"] == 1.5e-6 and df.loc[0, "git_sha"] == "x"
