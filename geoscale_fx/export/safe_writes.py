"""Writes into a directory the user owns that never harm what is already there.

The export writes into the user's checkpoint, and a checkpoint is often a Hugging Face hub
cache snapshot: ``snapshots/<rev>/config.json`` is a relative symlink to ``blobs/<hash>``, a
file named by its content's hash and shared by every revision with that content. Writing
through such a link would change every revision at once and leave a blob that no longer
has its name's hash. So every change the export makes is one of three steps, each atomic:

* ``replace_file(path, data)``: ``data`` goes to a temporary file in the same directory
  (``.<name>.geoscale-<random>.tmp``: a hidden name no loader lists), flushed and fsynced,
  then moved over ``path`` with ``os.replace`` and the directory fsynced. ``os.replace``
  replaces the directory entry, never the file behind it: a ``path`` that is a symlink
  becomes a regular file (with the mode of the file it pointed to) and the blob is never
  opened for writing. A reader sees the old content or the new one, never part of either.
  Content equal to what ``path`` already reads is not written at all (a re-run changes no
  file, and a link whose content stays stays a link).
* ``add_name(path, new)``: a second name for ``path`` in its directory, nothing copied: a
  symlink gets a twin link with the same (relative) target, a regular file a hard link.
* ``remove_name(path)``: the name removed (a link, never its target).

A renamed file is ``add_name`` then, once nothing needs the old name, ``remove_name``: the
data has a name at every moment (``os.rename`` would leave a moment where an index names a
file that does not exist yet, or a checkpoint without weights). ``check_writable(dir)``
refuses an output directory that cannot be written before any work is done. Every failure
is a ``CheckpointError`` naming the file and the system's reason; the steps before it stay
done, and none is half done.

Example::

    replace_file(Path("ckpt/config.json"), b"{...}\\n")   # a symlink there: now a file
    add_name(Path("ckpt/model.safetensors"), Path("ckpt/model-00001-of-00001.safetensors"))
    remove_name(Path("ckpt/model.safetensors"))
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from pathlib import Path

from geoscale_fx.core.errors import CheckpointError

__all__ = ["replace_file", "add_name", "remove_name", "check_writable", "make_directory",
           "same_file", "TEMP_MARK"]

log = logging.getLogger("geoscale_fx")

#: in every temporary file's name (``.<name>.geoscale-<random>.tmp``)
TEMP_MARK = ".geoscale-"


def _failed(path: Path, doing: str, exc: OSError) -> CheckpointError:
    reason = exc.strerror or str(exc)
    return CheckpointError(f"cannot {doing} {path}: {reason} (errno {exc.errno}; nothing of "
                           "this step was written)")


def replace_file(path: Path, data: bytes) -> bool:
    """``path`` holds ``data``, written atomically (see the module doc); False if it already
    did (nothing written)."""
    path = Path(path)
    with contextlib.suppress(OSError):
        if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
            return False
    mode, link = _mode_for(path), path.is_symlink()
    temp = path.with_name(f".{path.name}{TEMP_MARK}{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise _failed(path.parent, "create a file in", exc) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise _failed(path, "write", exc) from exc
    _sync_directory(path.parent)
    if link:
        log.info("geoscale: %s was a symlink: now a regular file; what it pointed to is "
                 "unchanged", path)
    return True


def _mode_for(path: Path) -> int | None:
    """The permission bits of what ``path`` reads now (the blob behind a link), or None
    (a new file: the umask's, as ``open`` gives)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None


def add_name(path: Path, new: Path) -> None:
    """``new`` names what ``path`` names: a symlink's twin (same target, so a relative
    target stays right in the same directory) or a hard link; nothing is copied. A ``new``
    that already names the same file is left as it is."""
    path, new = Path(path), Path(new)
    if same_file(path, new):
        return
    try:
        if path.is_symlink():
            os.symlink(os.readlink(path), new)
        else:
            os.link(path, new)
    except OSError as exc:
        hint = (" (the filesystem has no hard links: rename it yourself, or export with "
                "--out elsewhere)") if exc.errno in (errno.EPERM, errno.EOPNOTSUPP,
                                                     errno.EMLINK) else ""
        raise CheckpointError(f"cannot give {path} the name {new.name}: "
                              f"{exc.strerror or exc}{hint}") from exc
    _sync_directory(new.parent)


def remove_name(path: Path) -> None:
    """``path`` removed from its directory (a symlink itself, never what it points to)."""
    path = Path(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _failed(path, "remove", exc) from exc
    _sync_directory(path.parent)


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` both exist and read the same file (links followed)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_writable(directory: Path) -> None:
    """``CheckpointError`` unless files can be created in ``directory`` (or, if it does not
    exist yet, it can be made: its nearest existing parent is a writable directory). Nothing
    is left behind."""
    directory = Path(directory)
    existing = directory
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is not a directory" if existing.exists() else "does not exist"
        raise CheckpointError(f"cannot write to {directory}: {existing} {what}")
    if existing != directory:
        if not os.access(existing, os.W_OK | os.X_OK):
            raise CheckpointError(f"cannot create {directory}: {existing} is not writable")
        return
    probe = directory / f"{TEMP_MARK}probe-{secrets.token_hex(4)}.tmp"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise CheckpointError(f"cannot write to {directory}: {exc.strerror or exc} "
                              "(pass --out a writable directory, or out_dir=)") from exc
    os.unlink(probe)


def make_directory(directory: Path) -> None:
    """``directory`` and its missing parents made (``check_writable`` first)."""
    check_writable(directory)
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _failed(Path(directory), "create", exc) from exc


def _sync_directory(directory: Path) -> None:
    """fsync ``directory`` so that the step just taken survives a power loss in order
    (a filesystem that cannot open or sync a directory is skipped)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
