"""How a family starts: the zygote (runtime.family_init) or its image's template
(test_templates) forks its launcher (agent.launching), which holds nothing of the
daemon's but its log and the socket it makes network namespaces through (no other
fd, no environment variable but its heap choice)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from waiting import ended, eventually

from branchbox.runtime import procfs
from branchbox.sdk._portal import portal

# An interpreter reads it at its start, so a create that sets it starts its own: the
# zygote forks its launcher, not the image's template.
OWN_INTERPRETER = {"PYTHONDONTWRITEBYTECODE": "1"}


def test_a_launcher_is_forked_by_the_zygote_and_holds_only_its_log(harness, make) -> None:
    sb = make(env=OWN_INTERPRETER)
    launcher = harness.engine.get(sb.id).family.family.pid
    zygote = harness.engine.zygote
    assert Path(f"/proc/{launcher}/comm").read_text().strip() == "bb-launcher"
    parent = procfs.parent(launcher)  # a zygote; init once that zygote ended (an earlier test's)
    assert parent == zygote.pid or parent == 1 and zygote.pid is not None
    fds = {int(fd): os.readlink(f"/proc/{launcher}/fd/{fd}")
           for fd in os.listdir(f"/proc/{launcher}/fd")}
    log = str(harness.data_dir / "logs" / f"{sb.id}.log")
    assert {fd: fds.pop(fd) for fd in (0, 1, 2)} == {0: "/dev/null", 1: log, 2: log}
    kinds = sorted(target.partition(":")[0] for target in fds.values())
    # its own network namespace, the daemon's socket, a pidfd of the family's init
    assert kinds == ["anon_inode", "net", "socket"], fds
    assert "anon_inode:[pidfd]" in fds.values()
    environ = Path(f"/proc/{launcher}/environ").read_bytes().split(b"\0")
    assert {v.partition(b"=")[0] for v in environ if v} <= {b"BRANCHBOX_HUGE_HEAP"}
    assert sb.run_code("1 + 1").text == "2"


def test_the_zygote_ends_with_the_engine_and_its_families_run_on(harness, make) -> None:
    """Closing the zygote (as a daemon that stops or dies does) ends only the zygote."""
    sb = make(env=OWN_INTERPRETER)
    portal.run(harness.engine.settle())
    zygote = harness.engine.zygote
    first = zygote.pid
    zygote.close()
    assert ended(first)
    assert sb.run_code("'still here'").text == "'still here'"
    assert make(env=OWN_INTERPRETER).run_code("'and a new one'").text == "'and a new one'"


_NS_GET_USERNS = 0xB701


def test_a_launcher_makes_network_namespaces_its_family_owns(harness, make) -> None:
    """What fork children join (engine.networking): namespaces owned by the family's user
    namespace, which the launcher makes on request and the host's namespace is not."""
    sb = make()
    family = harness.engine.get(sb.id).family.family
    owner = os.stat(f"/proc/{family.pid}/ns/user").st_ino
    made = portal.run(family.make_namespaces(3))
    try:
        assert len(made) == 3
        inodes = set()
        for fd in made:
            assert os.readlink(f"/proc/self/fd/{fd}").startswith("net:")
            inodes.add(os.fstat(fd).st_ino)
            userns = fcntl.ioctl(fd, _NS_GET_USERNS)
            try:
                assert os.fstat(userns).st_ino == owner
            finally:
                os.close(userns)
        assert len(inodes) == 3  # three namespaces, none the launcher's own
        assert os.stat(f"/proc/{family.pid}/ns/net").st_ino not in inodes
    finally:
        for fd in made:
            os.close(fd)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def test_a_family_init_is_bb_init_reaping_and_holding_nothing(harness, make) -> None:
    """Once it has forked the first REPL, a family's init execs ``bb-init --reap`` (no
    Python heap per family): it holds no fd, and reaps the fork children it inherits
    (they are its children: CLONE_PARENT) when they are closed."""
    for sb in (make(), make(env=OWN_INTERPRETER)):  # a template's family, a zygote's
        launcher = harness.engine.get(sb.id).family.family.pid
        [init] = [c for c in _children(launcher)]
        assert Path(f"/proc/{init}/comm").read_text().strip() == "bb-family"
        assert Path(f"/proc/{init}/cmdline").read_bytes().split(b"\0")[:2] == [
            b"bb-init", b"--reap"]
        assert os.listdir(f"/proc/{init}/fd") == []
        kids = sb.fork(2)
        hosts = [harness.engine.get(k.id).body.repl_host for k in kids]
        assert set(hosts) <= set(_children(init))
        for kid in kids:
            kid.close()
        assert eventually(lambda: not set(hosts) & set(_children(init)))  # noqa: B023
        assert all(_state(c) != "Z" for c in _children(init))
