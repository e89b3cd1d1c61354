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
# A dangling symbolic link counts as an existing file (``os.link`` refuses it too). A name over
# the file system's limit (255 bytes), or a path over PATH_MAX, is refused up front; the hidden
# temporary name is shortened so that any legal name can be written.

# Note: [Unwritable at the end]
# The check before the work cannot promise the final write: a disk fills while a script trains,
# a quota is reached, a network file system fails. The work (a trace, a run's report) is then
# not lost: ``write_with_fallback`` writes it to a fresh folder under the system's temporary
# folder (else the home folder) and the error names both the file that could not be written and
# where its content went; an exception from the write is one line (``WriteError``), never a
# traceback.
"""

from __future__ import annotations

import errno
import os
import signal
import tempfile
from collections.abc import Callable, Iterable, Iterator
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
    "write_with_fallback",
    "WriteError",
]

NAME_MAX = 255  # bytes in one file name (ext4, xfs, btrfs, tmpfs, APFS)


class WriteError(CapuchinError):
    """An output could not be written (full disk, quota, I/O error); names the file and why."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _tmp_prefix(name: str) -> str:
    """The hidden temporary file's prefix for ``name``: ``.NAME.`` shortened so that the whole
    temporary name (plus mkstemp's 8 characters and ``.tmp``) stays within ``NAME_MAX``."""
    raw = os.fsencode(name)[: NAME_MAX - 16]
    return f".{os.fsdecode(raw).encode('utf-8', 'ignore').decode('utf-8', 'ignore')}."


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
    long = [part for part in p.parts if len(os.fsencode(part)) > NAME_MAX]
    if long:
        raise CapuchinError(
            f"{_short(p)}: a name of {len(os.fsencode(long[0]))} bytes; file systems allow at "
            f"most {NAME_MAX} per name"
        )
    try:
        os.lstat(p)
    except FileNotFoundError:
        pass
    except OSError as exc:  # a path over PATH_MAX, a loop of links, a file where a folder is
        if exc.errno != errno.ENOTDIR:
            raise CapuchinError(f"{_short(p)}: cannot use this path ({_reason(exc)})") from None
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
    if os.path.lexists(p) and not force:
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
    _free_space(existing, p)
    return p


def _short(p: Path) -> str:
    """``p`` for a message: whole, or its ends when over 200 characters."""
    s = str(p)
    return s if len(s) <= 200 else f"{s[:90]}...{s[-90:]} ({len(s)} characters)"


def _free_space(folder: Path, p: Path) -> None:
    """A file system with no free block at all fails the write after the work: refuse now."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):  # no statvfs (Windows), or nothing to ask
        return
    free = st.f_bfree if hasattr(os, "geteuid") and os.geteuid() == 0 else st.f_bavail
    if st.f_blocks and free == 0:
        raise CapuchinError(f"{_short(p)}: cannot write in {folder} (No space left on device)")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return a.resolve() == b.resolve()


def _probe(folder: Path, p: Path) -> None:
    try:
        fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(p.name), suffix=".tmp", dir=folder)
    except OSError as exc:
        raise CapuchinError(f"{_short(p)}: cannot write in {folder} ({_reason(exc)})") from None
    os.close(fd)
    os.unlink(tmp)


@contextmanager
def atomic_write(path: str | os.PathLike, *, force: bool = True) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s content to; on a normal exit it becomes
    ``path`` (see Note [Output files]); on any other exit it is removed. Without ``force`` an
    existing ``path`` is never replaced (``OutputExistsError``, the temporary removed)."""
    path = Path(path)
    if not force and os.path.lexists(path):
        raise exists_error(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=_tmp_prefix(path.name), suffix=".tmp", dir=path.parent)
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
    except OSError as exc:  # Note [Unwritable at the end]
        raise WriteError(f"{_short(path)}: cannot write ({_reason(exc)})") from None
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
    """``text`` (UTF-8) to ``path`` through ``write_with_fallback``."""
    return write_with_fallback(
        path, lambda tmp: tmp.write_text(text, encoding="utf-8"), force=force
    )


def write_with_fallback(
    path: str | os.PathLike, write: Callable[[Path], object], *, force: bool = True
) -> Path:
    """``write(tmp)`` the content of ``path`` through ``atomic_write``; when that fails (Note
    [Unwritable at the end]), write it to a fresh fallback folder instead and raise
    ``WriteError`` naming both places (or only the failure, when no fallback could be written)."""
    path = Path(path)
    try:
        with atomic_write(path, force=force) as tmp:
            write(tmp)
        return path
    except WriteError as exc:
        failed = exc
    name = os.fsdecode(os.fsencode(path.name)[:200]) or "output"
    for base in (tempfile.gettempdir(), Path.home()):
        try:
            folder = Path(tempfile.mkdtemp(prefix="capuchin-unsaved-", dir=base))
            with atomic_write(folder / name) as tmp:
                write(tmp)
        except (CapuchinError, OSError):
            continue
        raise WriteError(f"{failed}; its content was written to {folder / name} instead")
    raise failed


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
