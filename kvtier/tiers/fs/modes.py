"""Permission bits of what the fs tier creates: chunk files, their temporaries, ``config.json``,
and every directory it makes (``root_dir`` when absent, run and rank directories, shard directories).

Semantics callers rely on:

* A file or directory created through :class:`Modes` ends up with exactly ``file_mode`` /
  ``dir_mode`` (owner-only by default: ``0o600`` / ``0o700``), whatever the process umask: the
  mode is passed to ``open``/``mkdir``, and only where the umask would strip some of its bits
  (a group mode under umask ``077``) is it set again with ``fchmod`` on the new descriptor. On the
  default modes no umask strips anything an owner-only mode asks for, so creating a chunk costs
  no system call more than before.
* A directory's set-group-ID bit, inherited from its parent (how a group-shared ``root_dir`` hands
  its group to everything below it), is kept when the mode is set again.
* Files and directories that already exist are never changed (an older version's ``0o644`` /
  ``0o755`` stay until an operator changes them).
* The umask is read once, when a :class:`Modes` is made (a tier makes one when it is built): a
  process that tightens its umask later may create entries without group bits the new umask
  strips (never with more than the configured mode).

Modes are not a security boundary by themselves: they keep other local users out; a default
ACL on ``root_dir`` (if any) still applies as the kernel defines it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

__all__ = ["Modes", "PRIVATE", "current_umask"]


def current_umask() -> int:
    """The process umask, read without changing it where Linux tells it (``/proc/self/status``,
    Linux ≥ 4.7); elsewhere set and restored at once (another thread creating a file in that
    instant gets the stricter ``0o077``, never a looser mode)."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o077)
    os.umask(old)
    return old


@dataclass(frozen=True, slots=True)
class Modes:
    """The modes to create files and directories with, and whether the umask makes a second
    step (``fchmod``) necessary for each. Build with :meth:`for_umask`."""

    file: int
    dir: int
    fix_file: bool = False  # the umask strips bits of ``file``: set it again after creating
    fix_dir: bool = False

    @classmethod
    def for_umask(cls, file_mode: int, dir_mode: int, umask: int | None = None) -> Modes:
        """Modes for ``file_mode``/``dir_mode`` under ``umask`` (default: the process's, read now)."""
        mask = current_umask() if umask is None else umask
        return cls(file_mode, dir_mode, bool(file_mode & mask), bool(dir_mode & mask))

    def settle_file(self, fd: int) -> None:
        """Give the file just created at ``fd`` exactly :attr:`file` (a no-op unless the umask stripped
        some of it)."""
        if self.fix_file:
            os.fchmod(fd, self.file)

    def settle_dir(self, fd: int) -> None:
        """Give the directory just made, open at ``fd``, exactly :attr:`dir`, keeping an inherited
        set-group-ID bit (a no-op unless the umask stripped some of the mode)."""
        if self.fix_dir:
            os.fchmod(fd, self.dir | (os.fstat(fd).st_mode & stat.S_ISGID))


#: Owner-only, the fs tier's default (``file_mode`` 0o600, ``dir_mode`` 0o700): no umask strips
#: an owner's bits in practice, so nothing is set again. A umask that does (``0o277``) is handled
#: by :meth:`Modes.for_umask`, which the tier uses.
PRIVATE = Modes(0o600, 0o700)
