"""Files a command writes on a user's behalf (an image, a KV report, a plan, a policy table, a batch summary): checked
before any work starts, and written whole or not at all.

:func:`check_output_file` refuses, in one line naming the flag, an output path that

- is a folder, a device (``/dev/null``, ``/dev/full``), a FIFO or a socket (a write would replace the node or block),
  a symlink loop, or lies under a file;
- is empty (``''`` would mean the current folder);
- names one of the command's input files (compared after resolving symlinks, and by inode for hard links), or lies
  inside one of its input folders (``--images DIR``: every file there is an input);
- names an existing weights file (``.safetensors`` or a pickle) anywhere, or an existing file of a checkpoint folder:
  the command's ``--checkpoint``, or any folder holding a BAGEL checkpoint's :data:`CHECKPOINT_MARKERS` (the next
  load would fail); a caller may allow the names it is meant to write there (the calibration's policy table);
- sits in a folder that cannot be written or created.

:func:`write_atomically` writes into a new temporary file beside the target, then renames it onto the target, so a
failed or interrupted write leaves no partial or empty file and an existing one unchanged; a replaced file keeps its
permission bits. Every error is one line naming the flag and the path.

:func:`check_outputs` is the one call a command makes: it declares its outputs and its inputs once, checks every
output as above and refuses two outputs that are the same file (a JSON report and its ``.txt`` table, an image and
its report).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from .input_files import file_kind

#: Files whose presence makes a folder a BAGEL checkpoint (official layout) for the guard.
CHECKPOINT_MARKERS = ("llm_config.json", "ema.safetensors", "ae.safetensors")
#: Suffixes of weights files, never replaced by an output (safetensors, and pickles of torch.save).
WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def same_file(a: str | Path, b: str | Path) -> bool:
    """``a`` and ``b`` name one file: the same path after resolving symlinks, or one inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def _resolved(flag: str, path: Path, what: str) -> Path:
    """``path``, or for a dangling symlink the file it will create; a symlink loop is refused."""
    if path.is_symlink() and not path.exists():
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(
                    f"{flag}: {path} is a symlink loop; fix the link or give the path of the {what} to write"
                ) from None
        return Path(os.path.realpath(path))
    return path


def _is_checkpoint_folder(folder: Path) -> bool:
    return any((folder / marker).is_file() for marker in CHECKPOINT_MARKERS)


def _check_not_precious(flag: str, path: Path, what: str, checkpoints: Iterable[Path], allowed: Iterable[str]) -> None:
    """An existing weights file or checkpoint file is never replaced (see the module docstring)."""
    if not path.is_file():
        return
    real = Path(os.path.realpath(path))
    if real.suffix.lower() in WEIGHTS_SUFFIXES:
        raise ValueError(
            f"{flag}: {path} is a weights file; writing the {what} there would destroy it, give {flag} another path"
        )
    folders = [Path(os.path.realpath(c)) for c in checkpoints if c is not None and Path(c).is_dir()]
    if real.name not in set(allowed) and (real.parent in folders or _is_checkpoint_folder(real.parent)):
        raise ValueError(
            f"{flag}: {path} is a file of the checkpoint {real.parent}; writing the {what} there would replace it and "
            f"break the checkpoint, give {flag} a path outside the checkpoint folder"
        )


def _inside_folder(path: Path, folder: str | Path) -> bool:
    """``path`` lies somewhere under the existing folder ``folder`` (both resolved)."""
    if not os.path.isdir(folder):
        return False
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def _check_folder(flag: str, path: Path) -> None:
    """The folder of ``path`` is writable (a test file is created and removed), or can be created."""
    folder = path.parent
    probe = folder
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{flag}: {probe} is not a directory, so {path} cannot be created")
    if probe != folder:
        if not os.access(probe, os.W_OK | os.X_OK):
            raise OSError(f"{flag}: cannot create the folder {folder}: {probe} is not writable")
        return
    try:
        fd, name = _create_temporary(folder, ".unicache-write-test")
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise OSError(f"{flag}: cannot write into the folder {folder} ({exc.strerror or exc})") from None


def check_output_file(
    flag: str,
    path: str | Path,
    what: str,
    *,
    inputs: Iterable[tuple[str, str | Path | None]] = (),
    input_folders: Iterable[tuple[str, str | Path | None]] = (),
    checkpoints: Iterable[str | Path | None] = (),
    allowed_names: Iterable[str] = (),
) -> None:
    """Refuse an output ``path`` that a write would harm or could not reach (module docstring), before any work.

    Args:
        flag: the flag named in errors (``"--json"``).
        path: the file to write.
        what: what is written, for the advice (``"plan JSON"``).
        inputs: ``(flag, path)`` of the command's input files (``None`` paths skipped).
        input_folders: ``(flag, path)`` of folders whose every file is an input (``None`` paths skipped).
        checkpoints: checkpoint folders the command uses (others are recognised by :data:`CHECKPOINT_MARKERS`).
        allowed_names: file names this output may replace inside a checkpoint folder.
    """
    if str(path) in ("", "."):
        raise ValueError(f"{flag}: the path is empty; give the path of the {what} to write")
    path = _resolved(flag, Path(path), what)
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # a path under a file: named by the folder check below
        mode = None
    except OSError as exc:  # no permission on a folder
        raise OSError(f"{flag}: {path} cannot be written ({exc.strerror or exc}); give another path") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ValueError(f"{flag}: {path} is a directory; give the path of the {what} to write")
    if mode is not None and not stat.S_ISREG(mode):
        raise ValueError(
            f"{flag}: {path} exists and is not a regular file ({file_kind(mode)}); give the path of the {what} to write"
        )
    for other_flag, other in inputs:
        if other is None:
            continue
        if same_file(path, other):
            raise ValueError(
                f"{flag}: {path} is the same file as {other_flag} {other}; the {what} would overwrite it, give "
                f"{flag} its own path"
            )
    for other_flag, other in input_folders:
        if other is not None and (same_file(path, other) or _inside_folder(path, other)):
            raise ValueError(
                f"{flag}: {path} is inside the folder {other_flag} {other}, which the command reads; the {what} "
                f"would be written among its inputs, give {flag} a path outside that folder"
            )
    _check_not_precious(flag, path, what, [Path(c) for c in checkpoints if c is not None], allowed_names)
    _check_folder(flag, path)


def check_outputs(
    outputs: Iterable[tuple[str, str | Path | None, str]],
    *,
    inputs: Iterable[tuple[str, str | Path | None]] = (),
    input_folders: Iterable[tuple[str, str | Path | None]] = (),
    checkpoints: Iterable[str | Path | None] = (),
    allowed_names: Iterable[str] = (),
) -> None:
    """Every output of one command, before any work: each ``(flag, path, what)`` (``None`` paths skipped) through
    :func:`check_output_file` against all of ``inputs`` and ``input_folders``, and no two outputs the same file.
    Arguments as :func:`check_output_file`'s."""
    inputs, folders, checkpoints, names = list(inputs), list(input_folders), list(checkpoints), list(allowed_names)
    given = [(flag, path, what) for flag, path, what in outputs if path is not None]
    for index, (flag, path, what) in enumerate(given):
        check_output_file(
            flag, path, what, inputs=inputs, input_folders=folders, checkpoints=checkpoints, allowed_names=names
        )
        for other_flag, other, _ in given[:index]:
            if same_file(path, other):
                raise ValueError(
                    f"{flag}: {path} is the same file as {other_flag} {other}; the {what} would "
                    f"overwrite it, give {flag} its own path"
                )


def _create_temporary(folder: Path, stem: str) -> tuple[int, str]:
    """A new file in ``folder`` (``O_EXCL``; mode 0666 less the umask, as a plain write would make it)."""
    name = os.path.join(folder, f"{stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), name


def write_atomically(flag: str, path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a new temporary file beside ``path``, then rename it onto ``path`` (module docstring).

    Missing folders are created; a symlink is written through. A target that is no regular file by now is refused
    (never replaced). An ``OSError`` becomes one line naming ``flag`` and the path; any failure removes the
    temporary file.
    """
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() and not target.is_file():
            raise ValueError(f"{flag}: {path} is no longer a regular file; nothing was written")
        fd, tmp = _create_temporary(target.parent, f".{target.name}")
        try:
            if target.is_file():
                os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
        finally:
            os.close(fd)
        write(Path(tmp))
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        raise OSError(
            f"{flag}: cannot write {path} ({exc.strerror or exc}); free space or choose another path (nothing was "
            f"written)"
        ) from None
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)


def save_text(text: str, path: str | Path, flag: str) -> None:
    """Write UTF-8 ``text`` to ``path`` (named ``flag`` in errors) with :func:`write_atomically`."""
    write_atomically(flag, path, lambda tmp: tmp.write_bytes(text.encode("utf-8")))


__all__ = [
    "CHECKPOINT_MARKERS",
    "WEIGHTS_SUFFIXES",
    "check_output_file",
    "check_outputs",
    "same_file",
    "save_text",
    "write_atomically",
]
