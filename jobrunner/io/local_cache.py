"""A local cache directory built once, atomically, under a lock (model copies, GGUF conversions).

`build_dir_once` builds into a temporary sibling directory and renames it into place when complete, under an
exclusive `fcntl` lock, so several workers on one machine never see a half-written directory and only one of
them does the work. Local files only (the standard library): `jobrunner.models` and `jobrunner.io.model_fetch`
both fill their caches through it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def build_dir_once(target: Path, build: Callable[[Path], None],
                   is_current: Callable[[Path], bool] = lambda built: True) -> Path:
    """Make `target` exist by running `build(tmp_dir)` and renaming tmp_dir to `target`, at most once.

    Holds an exclusive `fcntl.flock` on `<target>.lock` while building, so concurrent callers (Ray workers
    on one machine) wait for the first one and then reuse its result. A failed build leaves no `target`
    (and an outdated one in place). An existing `target` for which `is_current` is false is built again
    and replaced.
    """
    if target.is_dir() and is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.with_name(target.name + ".lock")):
        if target.is_dir() and is_current(target):
            return target
        _remove_stale_builds(target)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=_tmp_prefix(target)))
        try:
            build(tmp)
            _make_readable(tmp)
            _retire(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _retire(target: Path) -> None:
    """Move an outdated `target` aside (a rename: readers holding its files keep them) and delete it."""
    if not target.exists():
        return
    old = Path(tempfile.mkdtemp(dir=target.parent, prefix=_tmp_prefix(target) + "old-"))
    os.replace(target, old / target.name)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (created if missing) for the duration."""
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _make_readable(directory: Path) -> None:
    """mkdtemp (and some writers) create owner-only entries; a shared cache should be world-readable."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o644)


def _tmp_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


def _remove_stale_builds(target: Path) -> None:
    """Delete temp dirs left by builds that crashed (safe: we hold the lock, nobody else is building)."""
    for stale in target.parent.glob(_tmp_prefix(target) + "*"):
        shutil.rmtree(stale, ignore_errors=True)
