"""geoscale_fx.export.safe_writes: atomic replacement, never through a symlink; names added
and removed without copying; output directories checked before any work. The export's use
of it (order, faults, hub caches) is in tests/export/test_compressed_tensors.py."""
from __future__ import annotations

import errno
import os
import stat

import pytest

from geoscale_fx.core.errors import CheckpointError
from geoscale_fx.export import safe_writes
from geoscale_fx.export.safe_writes import (
    TEMP_MARK, add_name, check_writable, make_directory, remove_name, replace_file,
)


def _blob_and_link(tmp_path, data=b"blob bytes\n"):
    """``blobs/abc`` and ``snap/config.json -> ../blobs/abc`` (relative, as the hub cache)."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snap").mkdir()
    blob = tmp_path / "blobs" / "abc"
    blob.write_bytes(data)
    os.chmod(blob, 0o644)
    link = tmp_path / "snap" / "config.json"
    os.symlink("../blobs/abc", link)
    return blob, link


def test_a_regular_file_is_replaced_whole_keeping_its_mode(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    inode = path.stat().st_ino
    assert replace_file(path, b"new content") is True
    assert path.read_bytes() == b"new content"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert path.stat().st_ino != inode                  # a new file moved over, not rewritten
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]   # no temp left


def test_a_symlink_becomes_a_regular_file_and_its_blob_is_untouched(tmp_path, caplog):
    blob, link = _blob_and_link(tmp_path)
    with caplog.at_level("INFO", logger="geoscale_fx"):
        assert replace_file(link, b"{}\n") is True
    assert f"{link} was a symlink: now a regular file" in caplog.text
    assert not link.is_symlink() and link.read_bytes() == b"{}\n"
    assert blob.read_bytes() == b"blob bytes\n"
    assert stat.S_IMODE(link.stat().st_mode) == 0o644     # the blob's mode
    assert sorted(p.name for p in link.parent.iterdir()) == ["config.json"]


def test_the_same_content_is_not_written_and_a_link_stays_a_link(tmp_path):
    blob, link = _blob_and_link(tmp_path)
    assert replace_file(link, b"blob bytes\n") is False
    assert link.is_symlink() and os.readlink(link) == "../blobs/abc"
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    inode = plain.stat().st_ino
    assert replace_file(plain, b"x") is False and plain.stat().st_ino == inode


def test_a_failed_replace_names_the_file_and_leaves_the_old_content(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors.index.json"
    path.write_bytes(b"old")

    def no_space(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safe_writes.os, "replace", no_space)
    with pytest.raises(CheckpointError, match=r"cannot write .*index.json: No space left on "
                                              r"device \(errno 28; nothing of this step"):
        replace_file(path, b"new")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]      # the temp file removed


def test_add_name_links_without_copying(tmp_path):
    blob, link = _blob_and_link(tmp_path)
    twin = link.with_name("model-00001-of-00001.safetensors")
    add_name(link, twin)
    assert twin.is_symlink() and os.readlink(twin) == "../blobs/abc"
    remove_name(link)
    assert not os.path.lexists(link) and blob.read_bytes() == b"blob bytes\n"
    assert twin.read_bytes() == b"blob bytes\n"
    plain = tmp_path / "model.safetensors"
    plain.write_bytes(b"weights")
    add_name(plain, tmp_path / "shard")
    assert (tmp_path / "shard").stat().st_ino == plain.stat().st_ino     # a hard link
    add_name(plain, tmp_path / "shard")                                  # already: a no-op
    (tmp_path / "other").write_bytes(b"weights")
    with pytest.raises(CheckpointError, match="cannot give .*model.safetensors the name other"):
        add_name(plain, tmp_path / "other")                      # the same bytes, not the file
    remove_name(tmp_path / "missing")                            # nothing there: a no-op


def test_check_writable_refuses_before_anything_is_written(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(CheckpointError, match=r"cannot write to .*a_file/out: .*a_file is not "
                                              "a directory"):
        check_writable(tmp_path / "a_file" / "out")
    check_writable(tmp_path / "new" / "deeper")                  # can be made: nothing made
    check_writable(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]   # the probe removed
    make_directory(tmp_path / "new" / "deeper")
    assert (tmp_path / "new" / "deeper").is_dir()


def test_check_writable_reports_the_systems_reason(tmp_path, monkeypatch):
    """A directory the process may not write (root may write anywhere, so the refusal is
    injected where the probe creates its file; the permission test below needs a user)."""
    real_open = os.open

    def denied(path, flags, mode=0o777):
        if TEMP_MARK in str(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(safe_writes.os, "open", denied)
    with pytest.raises(CheckpointError, match=r"cannot write to .*: Permission denied \(pass "
                                              "--out a writable directory"):
        check_writable(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_refused(tmp_path):
    os.chmod(tmp_path, 0o555)
    try:
        with pytest.raises(CheckpointError, match="Permission denied"):
            check_writable(tmp_path)
        with pytest.raises(CheckpointError, match="is not writable"):
            check_writable(tmp_path / "sub")
    finally:
        os.chmod(tmp_path, 0o755)
