"""A sandbox's directory tree deeper than Python's stack and than PATH_MAX, against the
daemon's walks of its layers (host root reading hostile trees).

A sandbox makes such a tree in a moment with relative steps (``mkdir d; cd d``, 3,000
times: 6,000 bytes of path). Before, the squash of a fork chain recursed once per
level (RecursionError: every later fork of that sandbox failed with a 500), and the
copy backend and image saving walked it with a fd or a path per level (EMFILE for
every other sandbox of the daemon while it ran; ENAMETOOLONG as a 500). What must
hold: forks, merges, squashes, saving an image and closing go through with a handful
of fds; what needs a path the host cannot name (diff, commit) is refused with a typed
422 ``PathTooLong``, and a refused commit leaves the host directory as it was.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from branchbox import Sandbox, SandboxError
from branchbox.engine import branching

DEPTH = 3000
MAKE = """
import os
os.makedirs({top!r}, exist_ok=True)
os.chdir({top!r})
for _ in range({depth}):
    os.mkdir("d")
    os.chdir("d")
open("leaf", "w").write("deep")
os.chdir("/")
"""
READ = ("import os\nos.chdir({top!r})\nfor _ in range({depth}):\n    os.chdir('d')\n"
        "print(open('leaf').read(), end='')\nos.chdir('/')")


def _refused_as_too_long(call) -> None:
    with pytest.raises(SandboxError) as refused:
        call()
    assert (refused.value.status, refused.value.kind) == (422, "PathTooLong"), refused.value


def test_a_deep_tree_forks_merges_squashes_saves_and_closes(harness) -> None:
    deep = {"top": "/root/deep", "depth": DEPTH}
    image = f"deep-{uuid.uuid4().hex[:8]}"
    with harness.sandbox() as sb:
        for n in range(branching.MAX_CHAIN + 3):  # past the chain's bound: squashed
            (kid,) = sb.fork(1)
            kid.run_code(MAKE.format(**deep) if n == 2 else f"open('/root/r{n}', 'w').close()")
            if n == 2:
                _refused_as_too_long(lambda: sb.diff(kid))  # noqa: B023 - called at once
            sb.merge_into(kid)
        assert harness.engine.info(sb.id)["layers"] <= branching.MAX_CHAIN + 1
        assert sb.run_code(READ.format(**deep)).stdout == "deep"
        last = branching.MAX_CHAIN + 2
        assert sb.run_code(f"print(open('/root/r{last}').read() == '')").stdout.strip() == "True"
        sb.save_image(image)
        try:
            with harness.sandbox(image=image) as saved:
                assert saved.run_code(READ.format(**deep)).stdout == "deep"
        finally:
            Sandbox.remove_image(image, transport=harness.transport())


def test_a_commit_of_a_path_too_long_for_the_host_is_refused_whole(
        harness, workspace: Path) -> None:
    with harness.sandbox(workspace=str(workspace)) as sb:
        sb.run_code(f"open({str(workspace / 'small')!r}, 'w').write('x')")
        sb.run_code(MAKE.format(top=str(workspace / "deep"), depth=DEPTH))
        _refused_as_too_long(sb.commit)
        assert os.listdir(workspace) == []  # all or nothing: not even the small file
        assert sb.exec(["rm", "-rf", str(workspace / "deep")]).exit_code == 0
        assert sb.commit()["changed"] == ["small"]
