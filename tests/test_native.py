"""Building and caching the C kernels (``metronome/native.py``)."""

from __future__ import annotations

import pytest

from metronome import native
from metronome.native import KernelBuildError, find_compiler, load_library

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C compiler to build the kernels with")


def test_a_built_library_is_loaded_from_the_cache(tmp_path, monkeypatch):
    first = load_library(tmp_path)
    assert first.vector_width in (4, 8, 16) and first.path.exists()
    monkeypatch.setattr(native, "_build", lambda *a: pytest.fail("built again despite the cache"))
    assert load_library(tmp_path).path == first.path


def test_a_damaged_cache_entry_is_built_again(tmp_path):
    name = load_library(tmp_path / "first").path.name    # (never overwrite a library this process has loaded)
    damaged = tmp_path / "second" / name
    damaged.parent.mkdir()
    damaged.write_bytes(b"not a shared library")
    assert load_library(tmp_path / "second").path == damaged and damaged.stat().st_size > 1000


def test_an_unwritable_cache_is_a_build_error(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(KernelBuildError, match="cannot build"):
        load_library(blocked / "kernels")


def test_cc_may_be_a_command_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", f"env {find_compiler()[0]}")
    assert load_library(tmp_path).path.exists()


def test_a_compiler_that_fails_says_how(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")        # runs, builds nothing
    with pytest.raises(KernelBuildError, match="exited 1"):
        load_library(tmp_path)
    assert not list(tmp_path.glob("*.so"))


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "k"))
    assert native.cache_dir() == tmp_path / "k"
    monkeypatch.delenv(native.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native.cache_dir() == tmp_path / "metronome" / "kernels"
