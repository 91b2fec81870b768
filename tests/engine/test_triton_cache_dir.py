"""Compiled Triton kernels live in specserve's cache folder (engine/core/cache_dir.py), so one
mounted volume keeps them across restarts; a folder the user chose wins."""

from __future__ import annotations

from engine.core.cache_dir import TRITON_CACHE_ENV, use_triton_cache_dir


def test_kernels_go_to_the_cache_folder_unless_the_user_chose_one(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "specserve"))
    monkeypatch.delenv(TRITON_CACHE_ENV, raising=False)
    assert use_triton_cache_dir() == str(tmp_path / "specserve" / "triton")
    monkeypatch.setenv(TRITON_CACHE_ENV, str(tmp_path / "mine"))
    assert use_triton_cache_dir() == str(tmp_path / "mine")


def test_triton_reads_the_folder_at_its_first_compile(tmp_path, monkeypatch):
    knobs = __import__("pytest").importorskip("triton").knobs
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(TRITON_CACHE_ENV, raising=False)
    use_triton_cache_dir()
    assert knobs.cache.dir == str(tmp_path / "triton")
