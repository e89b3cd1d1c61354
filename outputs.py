"""Output files, written one way by every command: checked before any work, written atomically,
never replaced without ``force``. No torch.

# Note: [Output files]
# A command calls ``check_output`` on each file it will write before it does any work (tracing,
# planning, training), so that a bad path costs nothing: the path must not be a folder nor one of
# the command's inputs (not even with --force: the input is read while the output is written),
# must not exist unless ``force``, must have a suffix the writer understands, and its folder (or
# the nearest existing one above it, where the writer will create it) must be one where a file can
# be created (probed by creating and removing a temporary file: as root, ``os.access`` says yes on
# read-only file systems and in /proc).
#
# ``atomic_write`` then writes through a hidden temporary file ``.NAME.XXXXXXXX.tmp`` in the same
# folder, which is removed on any exit from the block: an exception, KeyboardInterrupt (SIGINT),
# and SIGTERM, which the command turns into ``Terminated`` (``raise_on_sigterm``) and which
# ``atomic_write`` itself catches while it writes where nothing else handles it (a script using
# ``capuchin.Tracer``), to remove the temporary file before the process dies of it. The file gets the mode a
# new file would (``0o666 & ~umask``; mkstemp's is owner-only), then:
#   - with ``force``: ``os.replace`` (atomic; readers see the old file or the new one);
#   - without: ``os.link(tmp, path)`` and unlink the temporary. ``link`` fails when ``path``
#     exists, atomically, so a file that appeared while the command ran (another ``capuchin
#     trace`` to the same ``-o``) is kept and this command fails with ``OutputExistsError``.
#     On a file system without hard links the check and the rename are two steps (a window of
#     microseconds instead of the whole run).
"""

from __future__ import annotations

import errno
import os
import signal
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import CapuchinError, OutputExistsError, Terminated

__all__ = [
    "OutputExistsError",
    "Terminated",
    "atomic_write",
    "check_output",
    "raise_on_sigterm",
    "write_text",
]

# writers whose format follows the suffix (matplotlib) and the suffixes they can write
IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def exists_error(path: str | os.PathLike) -> OutputExistsError:
    """The one message for an output that exists."""
    return OutputExistsError(f"{path}: exists; use --force to overwrite")


def check_output(
    path: str | os.PathLike,
    *,
    force: bool = False,
    inputs: Iterable[str | os.PathLike | None] = (),
    suffixes: Iterable[str] | None = None,
) -> Path:
    """Check that ``path`` can be written before any work starts (see Note [Output files]).

    ``inputs``: the command's input files (None entries are skipped); ``path`` may not be one of
    them. ``suffixes``: the suffixes the writer can produce (lower case, with the dot). Returns
    ``path`` as a ``Path``; raises ``OutputExistsError`` or ``CapuchinError`` naming the path.
    """
    p = Path(path)
    if str(path) == "" or p.name in ("", ".", ".."):
        raise CapuchinError(f"{path!r}: not a file name")
    if p.is_dir():
        raise CapuchinError(f"{p}: is a folder; give a file name")
    for inp in inputs:
        if inp is not None and _same_file(p, Path(inp)):
            raise CapuchinError(f"{p}: is also the input {inp}; choose another output file")
    if suffixes is not None:
        allowed = tuple(suffixes)
        if p.suffix.lower() not in allowed:
            raise CapuchinError(
                f"{p}: cannot write this format (suffix "
                f"{p.suffix or '(none)'!r}); use one of {', '.join(allowed)}"
            )
    if p.exists() and not force:
        raise exists_error(p)
    folder = p.parent
    existing = folder
    while not existing.exists():
        if existing.is_symlink() or existing == existing.parent:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise CapuchinError(f"{p}: {existing} is not a folder")
    _probe(existing, p)  # the folder, or where the writer will create it
    return p


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return a.resolve() == b.resolve()


def _probe(folder: Path, p: Path) -> None:
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise CapuchinError(f"{p}: cannot write in {folder} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(tmp)


@contextmanager
def atomic_write(path: str | os.PathLike, *, force: bool = True) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s content to; on a normal exit it becomes
    ``path`` (see Note [Output files]); on any other exit it is removed. Without ``force`` an
    existing ``path`` is never replaced (``OutputExistsError``, the temporary removed)."""
    path = Path(path)
    if not force and path.exists():
        raise exists_error(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise CapuchinError(
            f"{path}: cannot write in {path.parent} ({exc.strerror or exc})"
        ) from None
    os.close(fd)
    tmp = Path(name)
    previous = _catch_default_sigterm()
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        if force:
            os.replace(tmp, path)
        else:
            _link_no_clobber(tmp, path)
    except Terminated:
        if previous is not None:  # we caught it: die of it, as the process would have
            tmp.unlink(missing_ok=True)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        tmp.unlink(missing_ok=True)
        restore_sigterm(previous)


def _catch_default_sigterm():
    """Where SIGTERM would kill the process outright (the default handler, in the main thread:
    a library user's script), catch it while a file is written so that the temporary file is
    removed first; ``atomic_write`` then lets SIGTERM kill the process. Returns the handler to
    restore, or None when nothing was changed (the command's ``raise_on_sigterm`` or the
    user's own handler is in place)."""
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return None
    except ValueError:
        return None
    return raise_on_sigterm()


def _link_no_clobber(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise OutputExistsError(
            f"{path}: exists (it appeared while this command ran); not "
            "replaced; use --force to overwrite"
        ) from None
    except OSError as exc:
        if exc.errno not in (
            errno.EPERM,
            errno.ENOTSUP,
            errno.EOPNOTSUPP,
            errno.EXDEV,
            errno.EMLINK,
            errno.ENOSYS,
        ):
            raise
        if path.exists():  # no hard links here: check, then rename
            raise OutputExistsError(
                f"{path}: exists (it appeared while this command ran); "
                "not replaced; use --force to overwrite"
            ) from None
        os.replace(tmp, path)


def write_text(path: str | os.PathLike, text: str, *, force: bool = True) -> Path:
    """``text`` (UTF-8) to ``path`` through ``atomic_write``."""
    with atomic_write(path, force=force) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def raise_on_sigterm():
    """Make SIGTERM raise ``Terminated`` in the main thread, so that ``finally`` blocks (the
    temporary files of ``atomic_write``) run as they do for SIGINT; forked children die of it as
    they would have without the handler. Returns the previous handler
    for ``restore_sigterm`` (None outside the main thread, where nothing changes)."""

    pid = os.getpid()

    def handler(signum, frame):
        if os.getpid() != pid:  # a forked child (a bounded solve, a DataLoader worker): die
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as it would have without us
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated(signum)

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def restore_sigterm(previous) -> None:
    """Undo ``raise_on_sigterm``."""
    if previous is not None:
        try:
            signal.signal(signal.SIGTERM, previous)
        except ValueError:
            pass
