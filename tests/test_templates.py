"""Creates fork their image's template (engine.templates, agent.launching): no
interpreter starts, yet each family is as apart from its siblings as one the zygote
starts, and its REPL is what a started one would be."""

from __future__ import annotations

import fcntl
import os
import signal
import struct
from pathlib import Path

import pytest
from waiting import ended, eventually

from branchbox.engine import templates
from branchbox.runtime import procfs
from branchbox.sdk._portal import portal

_NS_GET_USERNS = 0xB701
_NS_GET_PARENT = 0xB702
_NS_GET_OWNER_UID = 0xB704


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _ns_inode(fd: int, request: int) -> int:
    """The inode of the namespace ``request`` (an NS_GET_* ioctl) gives for ``fd``."""
    got = fcntl.ioctl(fd, request)
    try:
        return os.fstat(got).st_ino
    finally:
        os.close(got)


def _ns(pid: int, kind: str, request: int | None = None) -> int:
    fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
    try:
        return os.fstat(fd).st_ino if request is None else _ns_inode(fd, request)
    finally:
        os.close(fd)


def _owner_uid(pid: int) -> int:
    """The (host) uid that owns ``pid``'s user namespace."""
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
    try:
        return struct.unpack("I", fcntl.ioctl(fd, _NS_GET_OWNER_UID, bytes(4)))[0]
    finally:
        os.close(fd)


def _host_uid(pid: int) -> int:
    return int(procfs.status(pid)["Uid"].split()[0])


def _template_of(harness, sb) -> int:
    """The template REPL's pid that forked ``sb``'s launcher (asserting that one did)."""
    launcher = harness.engine.get(sb.id).family.family.pid
    template = procfs.parent(launcher)
    assert _comm(template) == "bb-template", f"{sb.id}'s launcher's parent is {_comm(template)}"
    assert _comm(procfs.parent(template)) == "bb-template-map"
    return template


def _status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split()[1]
    raise AssertionError(f"no {field} for {pid}")


def test_a_create_forks_its_images_template_and_its_repl_is_a_started_ones(harness,
                                                                          make) -> None:
    sb = make()
    template = _template_of(harness, sb)
    # The map writer (in the host's mount and PID namespaces) keeps only what writing a
    # family's id maps takes, in Z: CAP_DAC_OVERRIDE, CAP_SETGID, CAP_SETUID, CAP_SYS_ADMIN.
    writer = procfs.parent(template)
    for field in ("CapEff", "CapPrm", "CapBnd"):
        assert int(_status(writer, field), 16) == (1 << 1) | (1 << 6) | (1 << 7) | (1 << 21)
    assert _status(writer, "NoNewPrivs") == "1"
    repl = harness.engine.get(sb.id).body.repl_host
    assert _comm(repl) == "python3"
    # The image's site ran inside the sandbox: its venv's packages import as they would.
    assert "'/opt/venv/lib/python3.11/site-packages'" in sb.run_code(
        "import sys; sys.path").text
    assert sb.run_code("import pip; pip.__name__").text == "'pip'"
    env = sb.run_code("import os; sorted(os.environ)").text
    for name in ("LD_PRELOAD", "PYTHONMALLOC", "MIMALLOC_LARGE_OS_PAGES",
                 "BRANCHBOX_HUGE_HEAP"):
        assert name not in env
    assert "'HOSTNAME'" in env and "'PATH'" in env
    assert sb.run_code("import os; os.getcwd()").text == "'/root'"


def test_families_of_one_template_are_as_apart_as_the_zygotes(harness, make) -> None:
    """Own host ids, own user namespace (a child of the template's), a PID namespace the
    sandbox's root has no power over, and random state of its own."""
    a, b = make(), make()
    template = _template_of(harness, a)
    assert _template_of(harness, b) == template
    ra, rb = (harness.engine.get(sb.id).body.repl_host for sb in (a, b))
    assert _host_uid(ra) != _host_uid(rb)
    assert _host_uid(ra) != _host_uid(template) != _host_uid(rb)
    assert _ns(ra, "user") != _ns(rb, "user")
    template_userns = _ns(template, "user")
    for repl in (ra, rb):
        assert _ns(repl, "user", _NS_GET_PARENT) == template_userns
        # the family's PID namespace P belongs to the template's namespace, not the
        # family's: sandbox root can neither mount a proc of P nor enter it
        assert _ns(repl, "pid", _NS_GET_USERNS) == template_userns
        base = _host_uid(repl)
        assert Path(f"/proc/{repl}/uid_map").read_text().split() == ["0", str(base), "65536"]
        # owned by the family's own ids, not the template's root: the template keeps no
        # power over it, and its processes count against RLIMIT_NPROC as its own
        assert _owner_uid(repl) == base
    draws = {sb.run_code("import random; random.random()").text for sb in (a, b)}
    assert len(draws) == 2
    # what one family writes is owned by its own ids, not its sibling's
    a.run_code("open('/root/mine', 'w').write('a')")
    assert harness.host_path(a, "/root/mine").stat().st_uid == _host_uid(ra)


def test_an_environment_an_interpreter_reads_at_its_start_gets_an_interpreter(
        harness, make) -> None:
    """PYTHONPATH and its kind are read once, at an interpreter's start: such a create
    gets a started one (the zygote's launcher); what is read later (TZ) is read anew."""
    own = make(env={"PYTHONPATH": "/opt/extra"})
    launcher = harness.engine.get(own.id).family.family.pid
    assert _comm(procfs.parent(launcher)) != "bb-template"
    assert "'/opt/extra'" in own.run_code("import sys; sys.path").text
    forked = make(env={"TZ": "EST5"})
    _template_of(harness, forked)
    assert forked.run_code("import time; time.tzname").text == "('EST', 'EST')"


@pytest.fixture
def fresh_pool(harness):
    """The module's engine is shared: after a test that ends or retires a template, its
    warm pool's sandboxes (forked by that template, their launchers now orphans) go, so
    later tests get sandboxes of the current template. Before it, the pool is back to its
    configured size (not the size of the bursts earlier tests made): such a test counts
    which of its creates are hand-outs."""
    portal.run(harness.engine._drop_warm())
    harness.engine._demand.clear()
    yield
    portal.run(harness.engine._drop_warm())


def test_a_template_that_dies_is_replaced(harness, make, fresh_pool) -> None:
    first = make()
    template = _template_of(harness, first)
    os.kill(template, signal.SIGKILL)
    assert eventually(lambda: ended(template))
    # Its families run on, and so do those of the warm pool it forked; the next family
    # the engine starts finds it gone and is forked by a new one.
    assert first.run_code("'alive'").text == "'alive'"
    for _ in range(5):  # the pool's two, then one it started after the kill
        later = make()
        assert later.run_code("1 + 1").text == "2"
        parent = procfs.parent(harness.engine.get(later.id).family.family.pid)
        if parent != template and _comm(parent) == "bb-template":
            break
    assert parent != template and _comm(parent) == "bb-template", _comm(parent)


def test_a_forked_repl_is_what_a_started_one_is(harness, make) -> None:
    """Interpreter flags, sys.path and the signals an interpreter ignores at its start:
    the same in a template's REPL as in one the zygote started (an env var the
    interpreter reads at start, and that changes none of these, sends it there)."""
    probe = ("import signal, sys; (tuple(sys.flags), sys.path, "
             "[signal.getsignal(s) for s in (signal.SIGPIPE, signal.SIGXFSZ)])")
    forked, started = make(), make(env={"PYTHONIOENCODING": "utf-8"})
    _template_of(harness, forked)
    assert _comm(procfs.parent(harness.engine.get(started.id).family.family.pid)) != "bb-template"
    assert forked.run_code(probe).text == started.run_code(probe).text


def _memory_holds(pid: int, needle: bytes) -> bool:
    """Whether any readable mapping of ``pid`` holds ``needle`` (read as host root)."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if not perms.startswith("r") or line.rstrip().endswith("[vvar]"):
                continue
            for at in range(start, end, 1 << 24):
                try:
                    mem.seek(at)
                    chunk = mem.read(min(1 << 24, end - at) + len(needle))
                except OSError:
                    break
                if needle in chunk:
                    return True
    return False


def test_no_family_finds_another_familys_request_in_its_memory(harness, make,
                                                               monkeypatch) -> None:
    """A template's memory is every later family's: what one create asked for (its env:
    secrets, often) must not stay in it. The pool is kept empty so that the requests go
    through the template itself."""
    monkeypatch.setattr(harness.engine.config, "warm_pool", 0)
    portal.run(harness.engine._drop_warm())
    secret = f"s3cr3t-{os.urandom(8).hex()}"
    a = make(env={"API_TOKEN": secret})
    template = _template_of(harness, a)
    assert a.run_code("import os; os.environ['API_TOKEN']").text == repr(secret)
    repl_a = harness.engine.get(a.id).body.repl_host
    assert _memory_holds(repl_a, secret.encode())  # the probe finds it where it belongs
    assert not _memory_holds(template, secret.encode())
    b = make()
    assert _template_of(harness, b) == template
    assert not _memory_holds(harness.engine.get(b.id).body.repl_host, secret.encode())


def test_a_template_is_retired_after_its_launches(harness, make, monkeypatch,
                                                  fresh_pool) -> None:
    """Families of one template share its address-space layout and hash secret: after
    RETIRE_AFTER's launches a new template takes over, and the old one ends once the
    launches it began are done; its families run on."""
    monkeypatch.setattr(templates, "RETIRE_AFTER", (600.0, 2))
    monkeypatch.setattr(harness.engine.config, "warm_pool", 0)
    monkeypatch.setattr(harness.engine.config, "spawn_timeout", 5.0)
    portal.run(harness.engine._drop_warm())
    first = [make() for _ in range(3)]  # the third finds it stale and starts the next
    old = _template_of(harness, first[0])
    assert eventually(lambda: harness.engine._templates["default"].template.repl != old)
    later = make()
    assert _template_of(harness, later) != old
    assert eventually(lambda: ended(old))
    assert [sb.run_code("1 + 1").text for sb in first] == ["2"] * 3
