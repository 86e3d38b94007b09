"""A fork child's shared memory made its own: no page written in one branch shows in another.

fork() copies private memory copy-on-write, but a ``MAP_SHARED`` mapping stays
*one* mapping in every process that inherits it. Left as is, a fork child's
writes through such a mapping would land in its parent and its siblings: a
file the parent ``mmap``-ed (the pages are the parent's file, in the parent's
layer), ``multiprocessing`` values, locks and ``shared_memory`` blocks,
``mmap(-1, n)`` and System V segments. A fork must be a snapshot, as a
microVM's is, so every child replaces each of them before any user code runs
in it (``agent.forking``):

* a mapping of a file that exists at the same path in the child's own root is
  mapped again from there, with the same protection, flags and offset: the
  child sees the file as it was at the fork (its layer is the frozen snapshot)
  and its writes go to its own copy;
* anything else (anonymous shared memory, ``/dev/shm`` blocks, which a child's
  fresh ``/dev/shm`` does not have, deleted files, System V segments) is copied
  into new shared anonymous memory moved onto the same addresses (``mremap``,
  so no pointer changes), shared from then on only with the child's own
  processes. Of shared memory only pages in memory are copied (``mincore``):
  a sparse block costs what was written to it, not its size. With swap on, a
  page swapped out is not "in memory", so then every page is copied; so it is
  for a file on disk (a deleted one), whose clean pages may have been evicted.

The daemon lists the mappings from the host's /proc (``runtime.procfs``): the
REPL cannot see its own /proc. A mapping this module cannot copy (one that
cannot be made readable) is replaced by zeros and named in the fork's warning:
a child never keeps a page another branch can write.
"""

from __future__ import annotations

import ctypes
import os
import stat

from . import sysc

_PROTS = {"r": sysc.PROT_READ, "w": sysc.PROT_WRITE, "x": sysc.PROT_EXEC}


class Shared:
    """One ``MAP_SHARED`` mapping of the parent, as the daemon read it from maps."""

    __slots__ = ("end", "offset", "path", "prot", "size", "start")

    def __init__(self, start: int, end: int, prot: int, offset: int, path: str,
                 size: int | None) -> None:
        self.start, self.end, self.prot, self.offset, self.path = start, end, prot, offset, path
        self.size = size  # of the file on disk it maps, else None (shared memory)

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def writable(self) -> bool:
        """Writes through it could reach another branch (a read-only one of a file, such as
        glibc's gconv cache, is still mapped again: the parent may write to the file)."""
        return bool(self.prot & sysc.PROT_WRITE) or not self.path.startswith("/")


def plan(entries: list) -> list[Shared]:
    """The daemon's ``[start, end, perms, offset, path, size]`` entries, checked:
    page-aligned, non-empty, shared. Anything else is dropped (the daemon sends only what
    it read)."""
    found = []
    for entry in entries:
        try:
            start, end, perms, offset, path, size = entry
            start, end, offset = int(start), int(end), int(offset)
            size = None if size is None else int(size)
        except (TypeError, ValueError):
            continue
        if not (isinstance(perms, str) and isinstance(path, str) and len(perms) == 4
                and perms[3] == "s" and 0 <= start < end and offset >= 0
                and not (start | end) % sysc.PAGE):
            continue
        prot = sum(bit for flag, bit in _PROTS.items() if flag in perms[:3])
        found.append(Shared(start, end, prot, offset, path, size))
    return found


def make_private(mappings: list[Shared], swap: bool) -> list[str]:
    """Replace every mapping in ``mappings`` with memory of this process's own (this
    process: a fork child, single-threaded, in its own root). Returns the warnings: the
    mappings that could only be replaced by zeros."""
    lost = []
    for mapping in mappings:
        if _remap_file(mapping):
            continue
        try:
            _copy_anonymous(mapping, swap)
        except OSError as exc:
            sysc.mmap(mapping.start, mapping.length, mapping.prot,
                      sysc.MAP_SHARED | sysc.MAP_ANONYMOUS | sysc.MAP_FIXED)
            lost.append(f"{mapping.start:#x}-{mapping.end:#x} {mapping.path or '[shared]'}"
                        f" ({exc.strerror})")
    return lost


def _of_a_file(mapping: Shared) -> bool:
    """Whether the mapping names a file a child's root may have (not an anonymous or
    deleted mapping, not a ``/dev/shm`` block): a frozen layer keeps its content."""
    path = mapping.path
    return path.startswith("/") and not path.endswith(" (deleted)") \
        and not path.startswith("/dev/")


def instant_copies(mappings: list[Shared], swap: bool) -> list[int]:
    """For a checkpoint (``agent.checkpointing``), made in the REPL before its fork: its
    shared memory as ``bb_dormant.c`` takes it. What no file keeps is copied into
    private memory (start, length, prot, number of runs, then (offset, size) per run of
    pages; a woken copy makes it shared again once in its own cgroup), so the
    checkpoint keeps that memory as it is at this instant, whatever the REPL writes to it
    later; a file's mapping becomes a placeholder (start, length, prot, -1), mapped again
    from the checkpoint's frozen layer when it is woken."""
    words: list[int] = []
    for mapping in mappings:
        if _of_a_file(mapping):
            words += [mapping.start, mapping.length, mapping.prot, -1]
            continue
        try:
            runs = _runs(mapping, swap)
        except OSError:  # mincore refused: every page, then
            runs = [(0, mapping.length)]
        words += [mapping.start, mapping.length, mapping.prot, len(runs)]
        for offset, size in runs:
            words += [offset, size]
    return words


def _remap_file(mapping: Shared) -> bool:
    """Map the same file of this child's own root over the mapping; False if there is none
    (an anonymous or deleted mapping, a ``/dev/shm`` block, not a regular file)."""
    if not _of_a_file(mapping):
        return False
    path = mapping.path
    flags = os.O_RDWR if mapping.prot & sysc.PROT_WRITE else os.O_RDONLY
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)  # a FIFO
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        sysc.mmap(mapping.start, mapping.length, mapping.prot,
                  sysc.MAP_SHARED | sysc.MAP_FIXED, fd, mapping.offset)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _copy_anonymous(mapping: Shared, swap: bool) -> None:
    """New shared anonymous memory with the mapping's data, moved onto it: of a file on
    disk (a deleted one, say), every page within the file; of shared memory, the pages
    in memory."""
    start, length = mapping.start, mapping.length
    new = sysc.mmap(0, length, sysc.PROT_READ | sysc.PROT_WRITE,
                    sysc.MAP_SHARED | sysc.MAP_ANONYMOUS)
    try:
        # Readable first: it may have no read permission, or be a checkpoint's placeholder
        # (PROT_NONE, zeros) for a file this child's root does not have.
        sysc.mprotect(start, length, sysc.PROT_READ)
        for offset, size in _runs(mapping, swap):
            ctypes.memmove(new + offset, start + offset, size)
        if mapping.prot != sysc.PROT_READ | sysc.PROT_WRITE:
            sysc.mprotect(new, length, mapping.prot)
        sysc.mremap_onto(new, length, start)
    except OSError:
        sysc.munmap(new, length)
        raise


def _runs(mapping: Shared, swap: bool) -> list[tuple[int, int]]:
    """(offset, size) of the runs of pages to copy: for a file on disk, all within the
    file (past its end a read faults); for shared memory those in memory, or all with
    swap on (a swapped page is not in memory either)."""
    start, length = mapping.start, mapping.length
    if mapping.size is not None:
        within = max(0, min(length, mapping.size - mapping.offset))
        within = (within + sysc.PAGE - 1) // sysc.PAGE * sysc.PAGE
        return [(0, min(within, length))] if within else []
    if swap:
        return [(0, length)]
    runs: list[tuple[int, int]] = []
    for page, flag in enumerate(sysc.mincore(start, length)):
        if not flag & 1:
            continue
        offset = page * sysc.PAGE
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + sysc.PAGE)
        else:
            runs.append((offset, sysc.PAGE))
    return runs
