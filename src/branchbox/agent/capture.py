"""Fds 1 and 2 of the REPL during one ``run_code``: kept up to the output limit, no more.

Output written to the file descriptors directly (os.write, subprocesses, C
code) cannot go through the REPL's event writers. It used to go into memory
files, which hold all of it: 1 GB written by a subprocess was 1 GB of the
sandbox's memory (and an OOM kill under a memory limit) for output that is cut
at the limit anyway. Now fds 1 and 2 are pipes for the call, and a thread that
lives only as long as the call keeps each one's first ``keep`` bytes in a
memory file and counts the rest as dropped. A pipe never fills for good, so a
writer never blocks on it (with one thread nobody could drain a pipe while user
code runs; this thread does).

The thread exists only during a call: the REPL is single-threaded whenever the
daemon forks it. After the call the REPL's fds point back where they were; a
process the call started that still holds a pipe (a server in the background)
keeps writing into it, and what it writes is read and dropped until the last
writer closes it: by the agent's loop between calls, and by the next call's
thread during that call (the loop does not run then).

The thread is C (``bb_drain.c``, loaded from beside the agent's package): a Python
thread's start and its two GIL hand-offs cost each call ~0.15 ms in a sandbox. Where
that library cannot run (not x86_64, more pipes than it takes), a Python thread
drains the pipes.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import fcntl
import functools
import os
import select
import sys

from .server import Agent, RequestError

_libc_fflush = ctypes.CDLL(None).fflush
_libc_fflush.argtypes = [ctypes.c_void_p]
_DRAIN_LIBRARY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "bb-drain.so")  # beside bbagent/ in the agent layer
_DRAIN_MAX = 64  # bb_drain.c's BB_DRAIN_MAX

_F_SETPIPE_SZ = 1031
_PIPE_SIZE = 1 << 20  # fewer wake-ups for a fast writer (best effort: the system may cap it)
_READ = 1 << 16
_FINAL_DRAIN = 4 << 20  # bytes read after the call ends before its writers are left alone

_leftovers: list[int] = []
"""Read ends of earlier calls' pipes that a process still writes into (dropped data)."""


class _Drain(ctypes.Structure):
    """bb_drain.c's ``struct bb_drain``."""

    _fields_ = [("nfds", ctypes.c_int), ("own", ctypes.c_int), ("stop", ctypes.c_int),
                ("tid", ctypes.c_int), ("keep", ctypes.c_long), ("final_drain", ctypes.c_long),
                ("dropped", ctypes.c_long), ("error", ctypes.c_long),
                ("fds", ctypes.c_int * _DRAIN_MAX), ("files", ctypes.c_int * _DRAIN_MAX),
                ("kept", ctypes.c_long * _DRAIN_MAX), ("open", ctypes.c_int * _DRAIN_MAX)]


@functools.cache
def _drain_library() -> ctypes.CDLL | None:
    """bb-drain.so, loaded once (CDLL: the GIL is let go while a call waits in it); None
    where it is missing (the agent run bare, in its tests), cannot load or has no thread
    for this machine."""
    try:
        lib = ctypes.CDLL(_DRAIN_LIBRARY)
    except OSError:
        return None
    if not lib.bb_drain_native():
        return None
    for fn in (lib.bb_drain_start, lib.bb_drain_join):
        fn.argtypes, fn.restype = [ctypes.POINTER(_Drain)], ctypes.c_long
    return lib


def native() -> bool:
    """Whether calls are drained by bb-drain's C thread here."""
    return _drain_library() is not None


def flush_stdio() -> None:
    """Push what Python's and C's stdio buffers hold for fds 1 and 2 into those fds now."""
    for stream in (sys.__stdout__, sys.__stderr__):
        if stream is not None and not stream.closed:
            # The original stdout may be a pipe nobody reads any more; that is no reason
            # to fail the user's call.
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    _libc_fflush(None)


class FdCapture:
    """Fds 1 and 2 pointed at pipes for one call; ``files`` (memory files) hold the first
    ``keep`` bytes written to each, ``dropped`` counts the rest.

    Fresh for every call, so a fork child never shares one with its parent.
    """

    def __init__(self, agent: Agent, keep: int) -> None:
        flush_stdio()  # what was written before the call is not the call's output
        self._agent = agent
        self._keep = max(0, keep)
        self._saved: list[int] = []
        self._pipes: list[int] = []  # read ends, as the thread hands them back
        self.files: list[int] = []
        self.dropped = 0
        # Every fd first, then the redirection: out of fds (the REPL's open-file limit,
        # which user code can reach) the call fails with fds 1 and 2 untouched.
        made: list[int] = []
        try:
            ends = []
            for fd in (1, 2):
                ends.append(os.pipe2(os.O_CLOEXEC))
                made += ends[-1]
                self.files.append(os.memfd_create(f"branchbox-fd{fd}", os.MFD_CLOEXEC))
                made.append(self.files[-1])
                self._saved.append(os.dup(fd))
                made.append(self._saved[-1])
            self._stop_read, self._stop_write = os.pipe2(os.O_CLOEXEC)
        except BaseException:
            for fd in made:
                os.close(fd)
            self._saved, self.files = [], []
            raise
        for fd, (read, write) in zip((1, 2), ends, strict=True):
            with contextlib.suppress(OSError):
                fcntl.fcntl(read, _F_SETPIPE_SZ, _PIPE_SIZE)
            os.dup2(write, fd)  # inheritable, as fds 1 and 2 are
            os.close(write)
            self._pipes.append(read)
        for fd in _leftovers:  # this call's thread drains them while the loop waits
            with contextlib.suppress(KeyError, ValueError):  # a fork child's new loop
                agent.unwatch(fd)
        self._native = self._start_native()
        if self._native is None:
            # A bare thread and a lock it releases at its end: threading.Thread's start
            # and join handshakes cost ~90 us more, on every call.
            self._ended = _thread.allocate_lock()
            self._ended.acquire()
            try:
                _thread.start_new_thread(self._drain, ())
            except RuntimeError:  # no thread to be had: the sandbox's process limit
                self._ended.release()  # nothing to join
                self._pipes += _leftovers  # unwatched above: restore() watches them again
                _leftovers.clear()
                self.close()
                raise RequestError("ResourceLimit", "the sandbox's process limit is reached: "
                                   "no thread for the call's output (end some processes or "
                                   "threads first)") from None

    def _start_native(self) -> _Drain | None:
        """bb-drain's thread on this call's pipes and the leftovers; None if it cannot
        take them (then nothing was started and the leftovers are still listed)."""
        lib = _drain_library()
        fds = self._pipes + _leftovers
        if lib is None or len(fds) > _DRAIN_MAX:
            return None
        drain = _Drain(nfds=len(fds), own=len(self._pipes), stop=self._stop_read,
                       keep=self._keep, final_drain=_FINAL_DRAIN)
        drain.fds[:len(fds)] = fds
        drain.files[:len(self.files)] = self.files
        if lib.bb_drain_start(ctypes.byref(drain)) != 0:
            return None
        self._pipes = fds
        _leftovers.clear()
        return drain

    def _drain(self) -> None:
        try:
            self._drain_until_stopped()
        finally:
            self._ended.release()

    def _drain_until_stopped(self) -> None:
        """Until told to stop: read every pipe, keep what fits, drop the rest. Then read
        what is already there (at most _FINAL_DRAIN bytes) and end."""
        kept = dict.fromkeys(self._pipes, 0)
        files = dict(zip(self._pipes, self.files, strict=True))
        self._pipes += _leftovers
        _leftovers.clear()
        pipes = {fd: _identity(fd) for fd in self._pipes}
        poller = select.poll()
        for fd in (*self._pipes, self._stop_read):
            poller.register(fd, select.POLLIN)
        stopping, after, keeping = False, 0, True
        while self._pipes:
            ready = poller.poll(0 if stopping else None)
            if stopping and (not ready or after > _FINAL_DRAIN):
                return
            for fd, _ in ready:
                if fd == self._stop_read:
                    stopping = True
                    poller.unregister(fd)
                    continue
                now = _identity(fd)
                if now is None or now != pipes[fd]:  # closed (maybe reused) by user code
                    poller.unregister(fd)
                    self._pipes.remove(fd)
                    continue
                data = os.read(fd, _READ)
                if not data:  # every writer has closed it
                    poller.unregister(fd)
                    self._pipes.remove(fd)
                    os.close(fd)
                    continue
                after += len(data) if stopping else 0
                if fd not in kept:  # an earlier call's leftover writer: dropped
                    continue
                room = min(len(data), self._keep - kept[fd]) if keeping else 0
                if room > 0:
                    try:
                        _write_all(files[fd], data[:room])
                    except OSError:  # past an RLIMIT_FSIZE the cell set: drop the rest
                        keeping, room = False, 0
                    kept[fd] += room
                self.dropped += len(data) - room

    def restore(self) -> None:
        """Point fds 1 and 2 back where they were and collect what the pipes hold
        (idempotent)."""
        if not self._saved:
            return
        try:
            flush_stdio()
            for fd, saved in zip((1, 2), self._saved, strict=True):
                os.dup2(saved, fd)
                os.close(saved)
        finally:
            # The drain thread is stopped and joined whatever happened above (user code
            # may have closed any of these fds): a thread left running would outlive its
            # call. A stop pipe whose end user code closed stops it too (POLLHUP/NVAL).
            self._saved = []
            with contextlib.suppress(OSError):
                os.write(self._stop_write, b"x")
            if self._native is not None:
                self._join_native(self._native)
            else:
                self._ended.acquire()
            for fd in (self._stop_read, self._stop_write):
                with contextlib.suppress(OSError):
                    os.close(fd)
        for fd in self._pipes:  # still held by a process a call started
            self._agent.watch(fd, lambda fd=fd: _discard(self._agent, fd))
        _leftovers.extend(self._pipes)
        self._pipes = []

    def _join_native(self, drain: _Drain) -> None:
        """Wait for bb-drain's thread to end; take its count and close the pipes whose
        writers are all gone, as the Python thread does."""
        _drain_library().bb_drain_join(ctypes.byref(drain))
        self.dropped += drain.dropped
        still = []
        for i, fd in enumerate(self._pipes):
            if drain.open[i] == 1:
                still.append(fd)
            elif drain.open[i] == 0:  # (-1: user code closed it; the number is not ours)
                os.close(fd)
        self._pipes = still

    def close(self) -> None:
        self.restore()
        for mem in self.files:
            os.close(mem)
        self.files = []


def _identity(fd: int) -> tuple[int, int] | None:
    """Which file ``fd`` is (device, inode); None if it is not open."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _discard(agent: Agent, fd: int) -> None:
    """Called by the agent's loop: drop what a call's leftover writer wrote."""
    if not os.read(fd, _READ):  # the last writer is gone
        agent.unwatch(fd)
        _leftovers.remove(fd)
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
