"""Environment fingerprints: the run view and the result-row view of the same queries; NNRAND_GIT_SHA names
the commit of a copied tree."""
from __future__ import annotations

import re

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
    assert fp._git() == {"git_sha": "abc123def456", "git_dirty": None}
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
        assert short.split("-")[0] == sha[:12] and short in (sha[:12], sha[:12] + "-dirty")


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
