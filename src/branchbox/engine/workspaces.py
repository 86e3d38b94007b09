"""Workspaces: a host directory inside a sandbox, copy-on-write, and its commit back.

The workspace's bottom layer is an id-mapped detached mount of the host
directory; its upper layers live in the sandbox's own volume, so forks inherit
it. commit() hands the layers to storage.workspace_commit (crash-atomic) and
keeps first-commit-wins among branches of the same directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import secrets
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path

from branchbox.engine import errors
from branchbox.engine.idranges import IdRange
from branchbox.engine.layers import (
    WorkspaceBranch,
    WorkspaceLower,
)
from branchbox.engine.live import Body
from branchbox.engine.run_guard import OWN_REQUEST_WAIT
from branchbox.engine.stopped import describe
from branchbox.runtime.cgroups import FreezeFailed
from branchbox.storage import workspace_commit


class Workspaces:
    """Mixed into Engine (uses its config, layers, records and locks)."""

    def _workspace_host(self, workspace: str) -> Path:
        """Validate a host directory as a workspace; returns its real path."""
        if not isinstance(workspace, str) or not workspace.startswith("/") or "\0" in workspace:
            raise errors.InvalidRequest(f"workspace must be an absolute path: {workspace!r}")
        host = Path(os.path.realpath(workspace))
        if not host.is_dir():
            raise errors.InvalidRequest(f"workspace is not a directory on the host: {host}")
        forbidden = [Path("/"), *(Path(p) for p in ("/proc", "/sys", "/dev", "/run"))]
        data = self.config.data_dir.resolve()
        if host in forbidden or host.is_relative_to(data) or data.is_relative_to(host) \
                or any(host.is_relative_to(p) for p in forbidden[1:]):
            raise errors.InvalidRequest(f"{host} cannot be a workspace")
        return host

    def _workspace_branch(self, host: Path, ids: IdRange) -> WorkspaceBranch:
        """Open host directory ``host`` (validated) as a workspace of a family of ``ids``:
        its bottom layer shows host owners in that family's range."""
        lower = self._workspace_lowers.get((host, ids.slot))
        if lower is None or lower.users == 0:
            lower = WorkspaceLower(host, ids.host_tree(host))
            self._workspace_lowers[(host, ids.slot)] = lower
        return WorkspaceBranch(lower, since=time.time(),
                               version=self._workspace_versions.get(host, 0))

    async def commit(self, sandbox_id: str) -> dict:
        """Write the sandbox's workspace changes into the host directory, crash-atomically.

        First commit wins: a branch that started from an older version of the
        directory (a sibling committed first) gets StaleBranch and nothing changes.

        Returns ``workspace``, ``changed`` (relative paths), ``bytes``, ``version``,
        and what the host was protected from: ``stripped`` (``[{"path", "bits":
        ["setuid"|"setgid", ...]}]``: committed without those bits) and ``refused``
        (``[{"path", "kind": "fifo"|"socket"|"char device"|"block device"}]``: not
        created; the host keeps what it had there), and what to look at: ``links_out``
        (``[{"path", "target"}]``: symlinks created whose target is absolute or climbs
        out of the workspace). New entries are owned by the
        workspace directory's owner, replaced ones keep the host owner they had.
        """
        sb = self.get(sandbox_id)
        branch = sb.body.layers.workspace
        if branch is None:
            raise errors.InvalidRequest(f"sandbox {sandbox_id} has no workspace")
        host = branch.lower.host
        await self._acquire(sb, self.config.busy_wait)
        try:
            current = self._workspace_versions.get(host, 0)
            if branch.version != current:
                raise errors.StaleBranch(
                    f"{host} changed since sandbox {sandbox_id} branched from it: another "
                    "sandbox committed first (first commit wins)")
            self.records.begin_commit(host)
            self._thaw_guard.commit_started(host)  # recovered by it if we die meanwhile
            try:
                async with self._frozen_workspace(sb.body) as layers:
                    done = await self.content.run(
                        sb.body.layers.ids.family,
                        functools.partial(workspace_commit.commit, since=branch.since),
                        layers, host)
            except workspace_commit.WorkspaceConflict as exc:  # refused before any change
                self.records.end_commit(host)
                raise errors.Conflict(str(exc)) from None
            except FreezeFailed as exc:  # refused before anything was read
                self.records.end_commit(host)
                raise errors.Conflict(f"commit refused: {exc}") from None
            except Exception as exc:
                # It may have failed after its commit point: finish or undo it now, so the
                # directory is entirely old or entirely new before anyone looks.
                outcome = await asyncio.to_thread(workspace_commit.recover, host)
                self.records.end_commit(host)
                if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
                    raise errors.PathTooLong(f"commit into {host} failed ({outcome})"
                                             ) from None
                raise errors.EngineError(f"commit into {host} failed ({outcome}): "
                                         f"{type(exc).__name__}: {exc}") from None
            self.records.end_commit(host)
            self._workspace_versions[host] = current + 1
            self.records.set_workspace_version(host, current + 1)
            branch.version, branch.since = current + 1, time.time()
            sb.record.meta = {**sb.record.meta, "stack": describe(sb.body.layers)}
            self.records.put(sb.record)  # the branch's new version, for a re-attach
            self.events.publish("commit", sb.record, workspace=str(host), version=current + 1,
                                changed=len(done.changed))
            return {
                "workspace": str(host), "changed": done.changed, "bytes": done.bytes,
                "version": current + 1,
                "stripped": [{"path": s.path, "bits": _bit_names(s.bits)} for s in done.stripped],
                "refused": [{"path": r.path, "kind": r.kind} for r in done.refused],
                "links_out": [{"path": link.path, "target": link.target}
                              for link in done.links_out],
            }
        finally:
            sb.lock.release()

    @contextlib.asynccontextmanager
    async def _frozen_workspace(self, body: Body) -> AsyncIterator[list[Path]]:
        """The workspace's layer directories (top first) as one instant no sandbox process
        can change while commit reads them.

        The whole sandbox is frozen (the REPL and its threads too, not only the commands
        leaf), so the instant is consistent. On btrfs the writable volume is then
        snapshotted read-only (O(1)) and the sandbox thawed at once; commit reads the
        snapshot, which nothing can write. Elsewhere a snapshot would copy the whole
        root's layer, so the sandbox stays frozen for the commit instead. Either way
        commit resolves every path without following symlinks, which is what keeps a
        layer that does change (a sibling reaching in, a freeze that did not take) from
        pointing the daemon at a host file.
        """
        stack = body.layers
        frozen_uppers = stack.workspace_dirs()[1:]  # read-only snapshots already
        snapshot: Path | None = None
        body.cgroup.freeze()
        try:
            if self.store.backend.name == "btrfs":
                snapshot = self.layers.root / f"c-{secrets.token_hex(8)}"
                await asyncio.to_thread(self.store.backend.snapshot, stack.volume, snapshot,
                                        readonly=True)
                body.cgroup.freeze(frozen=False)
                yield [snapshot / "ws" / "upper", *frozen_uppers]
            else:
                yield stack.workspace_dirs()
        finally:
            body.cgroup.freeze(frozen=False)
            if snapshot is not None:
                self.layers.deleter.put(snapshot)

    async def _attach_workspace(self, body: Body, branch: WorkspaceBranch) -> None:
        """Mount a workspace into a running sandbox: its layers join the sandbox's volume
        and the REPL attaches the detached overlay at the host path."""
        self.layers.add_workspace(body.layers, branch)
        ((tree, path),) = body.layers.mounts()
        try:
            await asyncio.wait_for(body.channel.call("attach", {"path": path}, fds=[tree]),
                                   OWN_REQUEST_WAIT)
        finally:
            os.close(tree)


def _bit_names(bits: int) -> list[str]:
    """Permission bits as the names a user reads in the commit result."""
    return [name for bit, name in ((stat.S_ISUID, "setuid"), (stat.S_ISGID, "setgid"))
            if bits & bit]
