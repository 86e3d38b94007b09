"""Images: where a build fetches from (the host's apt and pip configuration), what the default
image holds (pip that installs, matplotlib charts as PNG, git, pytest, curl, a C toolchain),
and images saved from live sandboxes (save_image, image ls/rm)."""

from __future__ import annotations

import base64
import hashlib
import io
import textwrap
import zipfile
from pathlib import Path

import pytest

from branchbox import Sandbox
from branchbox.sdk import Conflict, InvalidRequest
from branchbox.storage import apt_sources

# -- the host's apt sources ---------------------------------------------------------------

ONE_LINE = textwrap.dedent("""\
    # the main archive, and a commented-out one
    # deb http://mirror.invalid/old bookworm main
    deb [arch=amd64 signed-by=/usr/share/keyrings/local.gpg] http://apt.local.test/debian/ \
    bookworm main contrib
    deb-src http://apt.local.test/debian bookworm main
    deb http://apt.local.test/debian-security bookworm-security main
""")

DEB822 = textwrap.dedent("""\
    Types: deb
    URIs: http://apt.local.test/debian-security
    Suites: bookworm-security
    Components: main

    Types: deb deb-src
    URIs: file:///srv/debian-mirror http://apt.local.test/debian
    Suites: trixie trixie-updates
    Components: main
    Signed-By: /etc/apt/keyrings/local.gpg

    Enabled: no
    Types: deb
    URIs: http://disabled.local.test/debian
    Suites: bookworm
    Components: main

    Types: deb
    URIs: http://inline.local.test/debian
    Suites: sid
    Components: main
    Signed-By:
     -----BEGIN PGP PUBLIC KEY BLOCK-----
     .
     mQINBF...
     -----END PGP PUBLIC KEY BLOCK-----
""")


def test_one_line_sources_give_uri_suite_components_and_keyring() -> None:
    sources = apt_sources.parse_one_line(ONE_LINE, "sources.list")
    assert [(s.uri, s.suites, s.components, s.signed_by) for s in sources] == [
        ("http://apt.local.test/debian/", ("bookworm",), ("main", "contrib"),
         "/usr/share/keyrings/local.gpg"),
        ("http://apt.local.test/debian-security", ("bookworm-security",), ("main",), None),
    ]


def test_deb822_stanzas_skip_disabled_ones_and_inline_keys() -> None:
    sources = apt_sources.parse_deb822(DEB822, "x.sources")
    assert [(s.uri, s.suites, s.signed_by) for s in sources] == [
        ("http://apt.local.test/debian-security", ("bookworm-security",), None),
        ("file:///srv/debian-mirror", ("trixie", "trixie-updates"), "/etc/apt/keyrings/local.gpg"),
        ("http://apt.local.test/debian", ("trixie", "trixie-updates"),
         "/etc/apt/keyrings/local.gpg"),
        ("http://inline.local.test/debian", ("sid",), None),  # an inline key is no file
    ]


def test_the_mirror_comes_from_the_sources_files(tmp_path: Path) -> None:
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list.d" / "local.sources").write_text(DEB822)
    (etc / "sources.list.d" / "ignored.list.disabled").write_text(ONE_LINE)
    sources = apt_sources.read_sources(etc)

    # A suite listed as such wins; the trailing slash goes.
    trixie = apt_sources.mirror_for("trixie", sources)
    assert (trixie.uri, trixie.keyring) == ("file:///srv/debian-mirror",
                                            "/etc/apt/keyrings/local.gpg")
    assert trixie.origin.endswith("local.sources")
    # Another suite of a Debian host: its main archive (never -security) serves it too.
    other = apt_sources.mirror_for("bookworm", sources, same_archive_ok=True)
    assert other.uri == "file:///srv/debian-mirror"
    # Not a Debian host: nothing to fall back on, and the message says what was read.
    with pytest.raises(apt_sources.NoMirror, match="suite 'bookworm'.*local.sources"):
        apt_sources.mirror_for("bookworm", sources, same_archive_ok=False)

    (etc / "sources.list").write_text(ONE_LINE)
    sources = apt_sources.read_sources(etc)
    bookworm = apt_sources.mirror_for("bookworm", sources, same_archive_ok=False)
    assert (bookworm.uri, bookworm.keyring) == ("http://apt.local.test/debian",
                                                "/usr/share/keyrings/local.gpg")


def test_no_sources_at_all_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(apt_sources.NoMirror, match="no sources files"):
        apt_sources.mirror_for("bookworm", apt_sources.read_sources(tmp_path / "nothing"))


# -- the default image --------------------------------------------------------------------


def test_a_matplotlib_figure_comes_back_as_png(make) -> None:
    sb = make()
    run = sb.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()")
    assert run.error is None, run.error
    png = base64.b64decode(run.results["image/png"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def _wheel(name: str, version: str, module: str) -> bytes:
    """A minimal pure-Python wheel (PEP 427) holding one module."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": module.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                         b"Tag: py3-none-any\n",
    }
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"  # noqa: E501
        for path, data in files.items()
    ) + f"{dist}/RECORD,,\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
        zf.writestr(f"{dist}/RECORD", record)
    return buffer.getvalue()


def test_pip_install_then_import_in_the_repl_copy_on_write(make) -> None:
    sb = make()
    sb.files.write("/tmp/bbwheel-1.0-py3-none-any.whl",
                   _wheel("bbwheel", "1.0", "ANSWER = 42\n"))
    done = sb.exec("pip install --no-index /tmp/bbwheel-1.0-py3-none-any.whl")
    assert done.exit_code == 0, done.stdout + done.stderr
    assert "externally-managed" not in done.stderr
    run = sb.run_code("import bbwheel, sys\n(bbwheel.ANSWER, sys.prefix)")
    assert run.error is None, run.error
    assert run.text == "(42, '/opt/venv')"
    # The install went into this sandbox's own layer: a new sandbox has no bbwheel.
    other = make()
    assert other.run_code("import bbwheel").error.name == "ModuleNotFoundError"


def test_the_repl_runs_in_the_venv_whatever_path_it_is_given(make) -> None:
    sb = make(env={"PATH": "/usr/bin:/bin"})
    assert sb.run_code("import sys; sys.prefix").text == "'/opt/venv'"
    assert sb.run_code("import matplotlib; 'ok'").text == "'ok'"


def test_the_default_image_has_the_tools_agents_reach_for(make) -> None:
    sb = make()
    done = sb.exec("git --version && python3 -m pytest --version && pytest --version && "
                   "curl --version && gcc --version && g++ --version && make --version")
    assert done.exit_code == 0, done.stdout + done.stderr
    run = sb.run_code("import numpy, pandas, scipy, requests, matplotlib\n"
                      "float(numpy.linalg.norm(numpy.array([3.0, 4.0])))")
    assert (run.error, run.text) == (None, "5.0")
    # The C toolchain and python headers build a native extension.
    sb.files.write("/tmp/ext/fast.c", b"""
#include <Python.h>
static PyObject *twice(PyObject *self, PyObject *arg) {
    return PyLong_FromLong(2 * PyLong_AsLong(arg));
}
static PyMethodDef methods[] = {{"twice", twice, METH_O, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "fast", NULL, -1, methods};
PyMODINIT_FUNC PyInit_fast(void) { return PyModule_Create(&mod); }
""")
    done = sb.exec("cd /tmp/ext && gcc -shared -fPIC $(python3-config --includes) fast.c "
                   "-o fast$(python3-config --extension-suffix)")
    assert done.exit_code == 0, done.stdout + done.stderr
    run = sb.run_code("import sys; sys.path.insert(0, '/tmp/ext'); import fast; fast.twice(21)")
    assert (run.error, run.text) == (None, "42")


# -- images saved from sandboxes ----------------------------------------------------------


def test_save_image_round_trip_shares_the_filesystem_not_the_memory(harness, make) -> None:
    source = make()
    source.files.write("/root/data/notes.txt", b"saved with the image\n")
    source.exec("rm /etc/hostname && mkdir -p /srv/x && touch /srv/x/y")
    source.run_code("in_memory = 1")
    info = source.save_image("with-notes")
    assert (info["name"], info["kind"], info["from_image"]) == ("with-notes", "saved", "default")
    source.files.write("/root/data/later.txt", b"after the save\n")

    sb = make(image="with-notes")
    assert sb.files.read("/root/data/notes.txt") == b"saved with the image\n"
    assert not sb.files.exists("/root/data/later.txt")
    assert not sb.files.exists("/etc/hostname")  # a deletion is saved too
    done = sb.exec("stat -c '%u:%g' /root/data/notes.txt /srv/x/y")
    assert done.stdout.split() == ["0:0", "0:0"]  # root's inside any family
    assert sb.run_code("in_memory").error.name == "NameError"
    assert sb.info()["image"] == "with-notes"
    # Writing in the new sandbox changes neither the image nor the sandbox it came from.
    sb.files.write("/root/data/notes.txt", b"changed\n")
    assert make(image="with-notes").files.read("/root/data/notes.txt") == (
        b"saved with the image\n")
    assert source.files.read("/root/data/notes.txt") == b"saved with the image\n"

    listed = {i["name"]: i for i in Sandbox.list_images(transport=harness.transport())}
    assert sb.id in listed["with-notes"]["users"]
    assert listed["default"]["kind"] == "built-in"


def test_an_image_saved_from_a_fork_child_and_stacked_again(harness, make) -> None:
    parent = make()
    parent.files.write("/root/a.txt", b"a")
    child = parent.fork(1)[0]
    try:
        child.files.write("/root/b.txt", b"b")
        child.exec("rm /root/a.txt")
        child.save_image("from-child")  # frozen layers below its own: squashed into one
    finally:
        child.close()
    first = make(image="from-child")
    assert (first.files.exists("/root/a.txt"), first.files.read("/root/b.txt")) == (False, b"b")
    first.files.write("/root/c.txt", b"c")
    first.save_image("from-child-2")
    second = make(image="from-child-2")
    assert second.exec("ls /root").stdout.split() == ["b.txt", "c.txt"]

    # Refused while in use, or while the base of another image; removable once neither.
    with pytest.raises(Conflict, match="used by"):
        Sandbox.remove_image("from-child-2", transport=harness.transport())
    first.close()
    with pytest.raises(Conflict, match="base of image"):
        Sandbox.remove_image("from-child", transport=harness.transport())
    second.close()
    Sandbox.remove_image("from-child-2", transport=harness.transport())
    Sandbox.remove_image("from-child", transport=harness.transport())
    names = [i["name"] for i in Sandbox.list_images(transport=harness.transport())]
    assert "from-child" not in names and "from-child-2" not in names
    with pytest.raises(InvalidRequest, match="unknown image"):
        make(image="from-child")


def test_image_names_are_checked(harness, make) -> None:
    sb = make()
    with pytest.raises(InvalidRequest):
        sb.save_image("../escape")
    with pytest.raises(Conflict, match="reserved"):
        sb.save_image("default")
    sb.save_image("taken")
    with pytest.raises(Conflict, match="exists"):
        sb.save_image("taken")
    Sandbox.remove_image("taken", transport=harness.transport())
    with pytest.raises(Conflict, match="built in"):
        Sandbox.remove_image("default", transport=harness.transport())


def test_images_hold_a_bounded_share_of_the_store(harness, make, monkeypatch) -> None:
    """Images outlive every sandbox and every limit: a loop of create, write, save, close
    filled the store for every family. They are at most BRANCHBOX_MAX_IMAGES and half of
    the store; past that a save is a 507 that says so, and nothing is left behind."""
    from branchbox import InsufficientStorage
    from branchbox.engine import images

    sb = make()
    held = len(harness.engine._saved_all())
    monkeypatch.setattr(harness.engine.config, "max_images", held + 1)
    sb.save_image("within-the-count")
    try:
        with pytest.raises(InsufficientStorage, match="BRANCHBOX_MAX_IMAGES"):
            sb.save_image("past-the-count")
        monkeypatch.setattr(harness.engine.config, "max_images", held + 10)
        monkeypatch.setattr(images, "IMAGES_SHARE", 1e-9)  # smaller than any image
        sb.exec("head -c 1M /dev/urandom > /root/data")
        with pytest.raises(InsufficientStorage, match="share of the store"):
            sb.save_image("past-the-share")
        assert not any(m["name"].startswith("past-") for m in harness.engine._saved_all())
    finally:
        Sandbox.remove_image("within-the-count", transport=harness.transport())
