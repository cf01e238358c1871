"""Environment fingerprints: NNRAND_GIT_SHA names the commit of a copied tree."""
from __future__ import annotations

from bench import fingerprint as bench_fp
from nnrand import fingerprint as run_fp


def test_git_sha_override(monkeypatch):
    monkeypatch.setenv("NNRAND_GIT_SHA", "abc123def456")
    run_fp._git.cache_clear()
    try:
        assert run_fp._git() == {"git_sha": "abc123def456", "git_dirty": None}
    finally:
        run_fp._git.cache_clear()
    assert bench_fp.git_sha() == "abc123def456"


def test_git_sha_from_the_checkout(monkeypatch):
    monkeypatch.delenv("NNRAND_GIT_SHA", raising=False)
    run_fp._git.cache_clear()
    try:
        sha = run_fp._git()["git_sha"]
    finally:
        run_fp._git.cache_clear()
    short = bench_fp.git_sha()
    if sha is None:  # no git here
        assert short == "unknown"
    else:
        assert len(sha) == 40 and short.split("-")[0] == sha[:12]
