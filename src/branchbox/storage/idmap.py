"""The host id ranges sandboxes run as, and shifting a tree's ownership into one.

Host ids from ``UID_BASE`` up are cut into *slots* of ``UID_COUNT`` ids. Slot 0
is where images are stored: their files are chowned into it once, when the
image is built (``shift_tree``), and no family ever runs in it. Every family
gets a slot k >= 1 of its own (``slot_base(k)``): its user namespace maps
0..65535 onto that slot's range, and the image appears there through an
id-mapped mount. Per-user kernel budgets (pipe buffers, inotify watches,
RLIMIT_NPROC...) are counted per host uid, so families with ranges of their
own cannot drain each other's.

Why ``SLOTS`` = 16384: the highest id any family can get is then
``UID_BASE + SLOTS * UID_COUNT - 1`` = 1,074,741,823, below 2**31 (software
that holds uids in a signed 32-bit int, and systemd's ranges above
0x7FFE0000) and far below 2**32 - 1 (the invalid id). Real host users live
below 65536 (login.defs' UID_MAX is 60000); what may overlap are subordinate
ranges of /etc/subuid and /etc/subgid (useradd hands them out from 100,000 in
steps of 65,536), so slots clashing with any id the host has handed out are
skipped (``host_claims``, ``clashing_slots``).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

UID_BASE = 1_000_000
UID_COUNT = 65536
SLOTS = 16384  # slot 0 (images) and families' slots 1..SLOTS-1; see the module's docstring

_SETID_BITS = stat.S_ISUID | stat.S_ISGID


def shift_tree(root: Path, base: int) -> None:
    """Add ``base`` to the uid and gid of ``root`` and of everything below it.

    Symlinks are chowned themselves, never followed; hardlinked files are
    shifted once. chown clears setuid/setgid on executables, so those mode
    bits are put back. Ids must be below ``UID_COUNT`` (what the user
    namespace can map): anything else raises ValueError, which also catches
    a tree that was shifted already. The walk stays on ``root``'s filesystem
    (a mount inside raises OSError EXDEV). On error the tree is left partly
    shifted; callers shift a scratch copy.
    """
    top = os.fspath(root)
    top_st = os.lstat(top)
    seen: set[int] = set()
    _shift(top, top_st, base, seen)
    pending = [top]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if st.st_dev != top_st.st_dev:
                    raise OSError(errno.EXDEV, "mount point inside the tree", entry.path)
                _shift(entry.path, st, base, seen)
                if stat.S_ISDIR(st.st_mode):
                    pending.append(entry.path)


def _shift(path: str, st: os.stat_result, base: int, seen: set[int]) -> None:
    """Shift one entry, given its lstat from before the change."""
    if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
        if st.st_ino in seen:
            return
        seen.add(st.st_ino)
    if not (0 <= st.st_uid < UID_COUNT and 0 <= st.st_gid < UID_COUNT):
        raise ValueError(
            f"{path}: uid/gid {st.st_uid}/{st.st_gid} is outside 0..{UID_COUNT - 1} "
            "(already shifted?)"
        )
    os.chown(path, st.st_uid + base, st.st_gid + base, follow_symlinks=False)
    if st.st_mode & _SETID_BITS and not stat.S_ISLNK(st.st_mode):
        os.chmod(path, stat.S_IMODE(st.st_mode))


def slot_base(slot: int) -> int:
    """First host id of slot ``slot`` (0: the images' storage range)."""
    if not 0 <= slot < SLOTS:
        raise ValueError(f"slot {slot} is outside 0..{SLOTS - 1}")
    return UID_BASE + slot * UID_COUNT


def host_claims(etc: Path = Path("/etc")) -> list[tuple[int, int]]:
    """Host id ranges (first, count) a family must not run in: every user and group id
    of passwd and group, and every subordinate range of subuid and subgid (another
    tool's containers run there). Missing or unreadable files claim nothing."""
    claims: list[tuple[int, int]] = []
    for name, first, count in (("passwd", 2, None), ("group", 2, None),
                               ("subuid", 1, 2), ("subgid", 1, 2)):
        try:
            lines = (etc / name).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(":")
            try:
                start = int(fields[first])
                length = 1 if count is None else int(fields[count])
            except (IndexError, ValueError):
                continue
            claims.append((start, length))
    return claims


def clashing_slots(claims: list[tuple[int, int]]) -> set[int]:
    """The slots whose range overlaps any of ``claims`` (first, count)."""
    found: set[int] = set()
    for start, length in claims:
        if length <= 0:
            continue
        first = max(0, (start - UID_BASE) // UID_COUNT)
        last = min(SLOTS - 1, (start + length - 1 - UID_BASE) // UID_COUNT)
        found.update(range(first, last + 1))
    return found


def template_map(own: int, families: set[int]) -> str:
    """The id map of a template's user namespace Z (``agent.launching``): Z's own slot
    ``own`` as ids 0.., and each of ``families`` (never ``own``) at ids
    ``slot * UID_COUNT``.., where :func:`in_template` finds it. One line per run of
    consecutive slots; ValueError past what the kernel takes."""
    lines = [f"0 {slot_base(own)} {UID_COUNT}"]
    run: list[int] = []
    for slot in [*sorted(families - {own}), None]:
        if run and (slot is None or slot != run[-1] + 1):
            lines.append(f"{run[0] * UID_COUNT} {slot_base(run[0])} {len(run) * UID_COUNT}")
            run = []
        if slot is not None:
            run.append(slot)
    text = "\n".join(lines) + "\n"
    if len(lines) > 340 or len(text) >= 4096:  # the kernel takes one write of under a page
        raise ValueError(f"a template's id map would take {len(lines)} lines, "
                         f"{len(text)} bytes (at most 340, under 4096)")
    return text


def in_template(base: int) -> int:
    """Where family slot starting at host id ``base`` is seen in a template's namespace."""
    return base - UID_BASE
