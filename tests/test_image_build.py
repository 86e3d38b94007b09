"""``image build``: images from a spec (FROM, RUN, ENV, WORKDIR, COPY), one cached layer per
step, shared and never copied; a failing step leaves no image; the context is hostile input."""

from __future__ import annotations

import io
import json
import os
import stat
import tarfile
from pathlib import Path

import httpx
import pytest
from conftest import Harness

from branchbox import Sandbox
from branchbox.sdk import Conflict, ImageBuildFailed, InvalidRequest
from branchbox.sdk._portal import portal
from branchbox.server.app import create_app
from branchbox.storage import image_spec

SPEC = """\
# every instruction, a continuation and a comment inside it
FROM default
ENV GREETING=hello NAME="two words"
ENV PLAIN value with spaces
WORKDIR /app
COPY greeting.txt lib ./
COPY ["run.sh", "/usr/local/bin/greet"]
RUN echo "$GREETING $NAME" > made.txt && \\
    # a comment inside a continued RUN
    pwd >> made.txt
WORKDIR sub
RUN touch here
"""


@pytest.fixture
def context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "lib" / "deep").mkdir(parents=True)
    (ctx / "greeting.txt").write_text("hi from the context\n")
    (ctx / "lib" / "deep" / "mod.py").write_text("X = 1\n")
    (ctx / "run.sh").write_text("#!/bin/sh\necho greeted\n")
    (ctx / "run.sh").chmod(0o4755)  # setuid: COPY drops it
    return ctx


def build(harness, name: str, spec: str, context: Path | None = None) -> tuple[dict, list]:
    events: list[dict] = []
    info = Sandbox.build_image(name, spec, context, on_event=events.append,
                               transport=harness.transport())
    return info, events


def cached_steps(events: list[dict]) -> list[bool]:
    return [e["cached"] for e in events if e["type"] == "step"]


def remove(harness, *names: str) -> None:
    for name in names:
        Sandbox.remove_image(name, transport=harness.transport())


def test_a_spec_builds_and_a_sandbox_sees_every_step(harness, make, context) -> None:
    info, events = build(harness, "every-step", SPEC, context)
    assert (info["name"], info["kind"], info["steps"]) == ("every-step", "built", 9)
    assert [e["text"] for e in events if e["type"] == "step"][:3] == [
        "FROM default", "ENV GREETING=hello 'NAME=two words'", "ENV 'PLAIN=value with spaces'"]
    sb = make(image="every-step")
    done = sb.exec("pwd; cat /app/made.txt /app/greeting.txt /app/deep/mod.py; greet; "
                   "echo \"$GREETING|$NAME|$PLAIN\"; ls /app/sub; stat -c '%u:%g %a' "
                   "/usr/local/bin/greet /app/greeting.txt")
    assert done.exit_code == 0, done.stderr
    assert done.stdout.splitlines() == [
        "/app/sub", "hello two words", "/app", "hi from the context", "X = 1", "greeted",
        "hello|two words|value with spaces", "here", "0:0 755", "0:0 644"]
    assert sb.run_code("import os; os.environ['GREETING']").text == "'hello'"
    listed = {i["name"]: i for i in Sandbox.list_images(transport=harness.transport())}
    assert listed["every-step"]["users"] == [sb.id]
    with pytest.raises(Conflict, match="used by"):
        remove(harness, "every-step")
    sb.close()
    remove(harness, "every-step")


def test_layers_are_cached_and_shared_and_a_changed_step_rebuilds_from_there(
        harness, context) -> None:
    spec = "FROM default\nRUN echo one > /one\nCOPY greeting.txt /g\nRUN echo two > /two\n"
    first, events = build(harness, "cache-a", spec, context)
    assert cached_steps(events)[1:] == [False, False, False]
    again, events = build(harness, "cache-b", spec, context)
    assert cached_steps(events)[1:] == [True, True, True]
    changed, events = build(harness, "cache-c", spec.replace("echo two", "echo 2"), context)
    assert cached_steps(events)[1:] == [True, True, False]
    (context / "greeting.txt").write_text("changed content\n")  # COPY's key has its content
    copied, events = build(harness, "cache-d", spec, context)
    assert cached_steps(events)[1:] == [True, False, False]
    saved = {n: harness.engine._saved(n)["lowers"] for n in ("cache-a", "cache-b", "cache-c",
                                                             "cache-d")}
    assert saved["cache-a"] == saved["cache-b"]  # the same layers, not copies
    assert saved["cache-c"][1:] == saved["cache-a"][1:] and saved["cache-c"][0] != (
        saved["cache-a"][0])
    assert saved["cache-d"][2:] == saved["cache-a"][2:]
    # Removing an image keeps the layers others use; the last one takes them along.
    remove(harness, "cache-a", "cache-c", "cache-d")
    assert all(Path(p).exists() for p in saved["cache-b"][:3])
    remove(harness, "cache-b")
    assert not any(Path(p).exists() for p in saved["cache-b"][:3])
    assert not list((harness.data_dir / "images" / "steps").glob("*.json"))


def test_a_failing_step_shows_its_output_and_leaves_no_image(harness, context) -> None:
    spec = "FROM default\nRUN echo made it\nRUN echo about to fail; echo oops >&2; exit 3\n"
    with pytest.raises(ImageBuildFailed, match=r"(?s)step 3/3 RUN echo about to fail.*"
                       r"status 3.*about to fail.*oops"):
        build(harness, "fails", spec, context)
    names = [i["name"] for i in Sandbox.list_images(transport=harness.transport())]
    assert "fails" not in names
    with pytest.raises(InvalidRequest, match="unknown image"):
        harness.sandbox(image="fails")
    # The step that succeeded is reused by the next attempt.
    info, events = build(harness, "fails", spec.replace("exit 3", "true"), context)
    assert cached_steps(events)[1:] == [True, False]
    remove(harness, "fails")


def test_env_variables_expand_in_workdir_and_copy(harness, make, context) -> None:
    spec = ("FROM default\nENV APP=/srv/app\nENV DATA=${APP}/data\nWORKDIR $APP\n"
            "COPY greeting.txt $DATA/\nRUN echo '$APP stays for the shell:' $APP > run.txt\n")
    build(harness, "expanded", spec, context)
    sb = make(image="expanded")
    done = sb.exec("pwd; cat data/greeting.txt run.txt; echo $DATA")
    assert done.stdout.splitlines() == ["/srv/app", "hi from the context",
                                        "$APP stays for the shell: /srv/app", "/srv/app/data"]
    sb.close()
    remove(harness, "expanded")


def test_from_a_debian_suite(harness, make) -> None:
    # Debootstrapped from the host's apt sources on first use (minbase and python3), cached.
    build(harness, "bare-bookworm", "FROM bookworm\nRUN echo 'ID=bare' > /etc/bare\n")
    sb = make(image="bare-bookworm")
    done = sb.exec("cat /etc/bare /etc/debian_version; test -e /opt/venv || echo no venv")
    assert done.exit_code == 0, done.stderr
    assert done.stdout.split()[0] == "ID=bare" and done.stdout.split()[1].startswith("12.")
    assert done.stdout.splitlines()[-1] == "no venv"
    assert sb.run_code("import sys; sys.executable").text == "'/usr/bin/python3'"
    sb.close()
    remove(harness, "bare-bookworm")


def test_images_survive_a_restart_of_the_daemon(tmp_path) -> None:
    first = Harness("btrfs")
    try:
        Sandbox.build_image("kept-built", "FROM default\nRUN echo built > /built\n",
                            transport=first.transport())
        source = first.sandbox()
        source.files.write("/saved", b"saved")
        source.save_image("kept-saved")
        source.close()
    finally:
        first.stop(keep_data=True)
    again = Harness("btrfs", first.data_dir)
    try:
        for image, path, data in (("kept-built", "/built", b"built\n"),
                                  ("kept-saved", "/saved", b"saved")):
            sb = again.sandbox(image=image)
            assert sb.files.read(path) == data
            sb.close()
        remove(again, "kept-built", "kept-saved")
    finally:
        again.stop()


def test_a_bad_spec_or_name_is_refused_before_anything_runs(harness) -> None:
    cases = [("FROM default\nADD x /x\n", "line 2: 'ADD' is not supported"),
             ("RUN true\n", "starts with FROM"),
             ("FROM no-such-image\n", "no such image"),
             ("FROM default\nCOPY ../secret /x\n", "outside the build context"),
             ("FROM default\nCOPY missing.txt /x\n", "matches nothing")]
    for spec, message in cases[:4]:
        with pytest.raises(InvalidRequest, match=message):
            build(harness, "bad-spec", spec)
    with pytest.raises(ImageBuildFailed, match=cases[4][1]):
        build(harness, "bad-spec", cases[4][0])
    with pytest.raises(InvalidRequest, match="image name"):
        build(harness, "../x", "FROM default\n")
    with pytest.raises(Conflict, match="reserved"):
        build(harness, "host", "FROM default\n")
    assert "bad-spec" not in [i["name"] for i in Sandbox.list_images(
        transport=harness.transport())]


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:") as tar:
        spec = b"FROM default\nCOPY . /ctx/\n"
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(spec)
        tar.addfile(info, io.BytesIO(spec))
        for member, data in members:
            tar.addfile(member, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes | None = b"x",
            mode: int = 0o644, link: str = "") -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname = kind, mode, link
    info.size = len(data) if data is not None and kind == tarfile.REGTYPE else 0
    return info, data if kind == tarfile.REGTYPE else None


def _post(app, body: bytes, name: str) -> httpx.Response:
    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://branchbox") as client:
            return await client.post("/v1/images", params={"name": name}, content=body)
    return portal.run(send())


def test_the_context_cannot_escape_or_plant_special_files(harness, make) -> None:
    app = harness.app
    for body in (b"", b"not a tar at all" * 100, _tar()[:700]):
        reply = _post(app, body, "junk")
        assert reply.status_code == 400 and set(reply.json()) == {"error", "type"}, reply.text
    for member, message in [
            (_member("../up.txt"), "outside the context"),
            (_member("/abs.txt"), "outside the context"),
            (_member("fifo", tarfile.FIFOTYPE), "special file"),
            (_member("dev", tarfile.CHRTYPE), "special file"),
            (_member("hard", tarfile.LNKTYPE, link="Dockerfile"), "hard link")]:
        reply = _post(app, _tar(member), "hostile")
        assert reply.status_code == 400, reply.text
        assert message in reply.json()["error"]
    # A link to a host secret is copied as a link (never followed); setuid is dropped.
    reply = _post(app, _tar(_member("shadow", tarfile.SYMTYPE, link="/etc/shadow"),
                            _member("suid", data=b"#!/bin/sh\n", mode=0o6755)), "linked")
    assert reply.status_code == 200, reply.text
    lines = [json.loads(line) for line in reply.text.splitlines()]
    assert lines[-1]["type"] == "image", lines[-1]
    sb = make(image="linked")
    done = sb.exec("readlink /ctx/shadow; stat -c '%a' /ctx/suid; ls /ctx")
    assert done.stdout.split() == ["/etc/shadow", "755", "shadow", "suid"]
    sb.close()
    remove(harness, "linked")


def test_a_context_over_the_upload_limit_is_refused(harness) -> None:
    small = create_app(harness.engine, max_upload=4096)
    reply = _post(small, _tar(_member("big.bin", data=b"\0" * 8192)), "too-big")
    assert reply.status_code == 413 and "limit" in reply.json()["error"]
    assert not list((harness.data_dir / "run").glob("context-*"))


def test_removing_an_image_lets_go_of_its_id_mapped_views(harness, make) -> None:
    source = make()
    source.files.write("/root/kept.txt", b"kept")
    source.save_image("mapped")
    sb = make(image="mapped")
    assert sb.files.read("/root/kept.txt") == b"kept"
    layer = Path(harness.engine._saved("mapped")["lowers"][0])
    views = lambda: [m for m in harness.engine.ids._maps.values() if layer in m.lowers]  # noqa: E731
    assert views()  # the family's slot maps the image's layer
    sb.close()
    remove(harness, "mapped")
    assert not views()


def test_save_image_waits_for_the_call_under_way(harness, make) -> None:
    sb = make()
    runner = harness.start_run(
        sb, "import time; time.sleep(2); open('/root/late.txt', 'w').write('late')")
    try:
        sb.save_image("after-the-call")
    finally:
        runner.join()
    later = make(image="after-the-call")
    assert later.files.read("/root/late.txt") == b"late"
    later.close()
    remove(harness, "after-the-call")


# -- the spec, without a daemon -----------------------------------------------------------


def test_spec_parsing() -> None:
    spec = image_spec.parse(SPEC)
    assert spec.base == "default"
    assert [s.kind for s in spec.steps] == ["ENV", "ENV", "WORKDIR", "COPY", "COPY", "RUN",
                                            "WORKDIR", "RUN"]
    run = spec.steps[5]
    assert run.args == ("/bin/sh", "-c", 'echo "$GREETING $NAME" > made.txt && pwd >> made.txt')
    assert spec.steps[4].args == ("run.sh", "/usr/local/bin/greet")
    exec_form = image_spec.parse('from default\nrun ["echo", "a b"]\n').steps[0]
    assert exec_form.args == ("echo", "a b")
    assert image_spec.workdir("/app", "sub/../other") == "/app/other"
    assert image_spec.expand(r"$A/${B}x/\$C/$UNSET.", {"A": "1", "B": "2"}) == "1/2x/$C/."
    env_step = image_spec.parse("FROM a\nENV X=$Y/z W=${Y}\n").steps[0]
    assert image_spec.expanded(env_step, {"Y": "/y"}).args == ("X=/y/z", "W=/y")
    for bad, message in [("FROM a\nFROM b\n", "only one FROM"),
                         ("FROM a\nENV 1X=2\n", "not a variable name"),
                         ("FROM a\nCOPY --chown=1 a b\n", "not supported"),
                         ("FROM a\nRUN [1]\n", "JSON list of strings"),
                         ("FROM a\nRUN x \\\n", "continuation")]:
        with pytest.raises(image_spec.SpecError, match=message):
            image_spec.parse(bad)


def test_the_sdk_refuses_a_context_with_a_special_file(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    os.mkfifo(ctx / "pipe")
    assert stat.S_ISFIFO((ctx / "pipe").lstat().st_mode)
    with pytest.raises(InvalidRequest, match="special file"):
        Sandbox.build_image("x", "FROM default\n", ctx, url="http://127.0.0.1:9")
