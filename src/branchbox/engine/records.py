"""Sandbox metadata in SQLite, in the data directory.

The database outlives the daemon: after a crash or restart the new daemon reads
which sandboxes were live and which family launchers ran them (``meta.launcher``), re-attaches to
those still running (engine.reattach), keeps the files of the others (``stopped``,
engine.stopped) and closes the rest, so nothing leaks. What it needs of a live
sandbox is in its record's ``meta``: ``stack`` (its layers), ``gen`` and
``forked_at`` (merge staleness), ``expires`` or ``timeout_left`` (its lifetime).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    parent_id TEXT,
    family TEXT NOT NULL,
    instance TEXT NOT NULL,
    state TEXT NOT NULL,
    image TEXT NOT NULL,
    created REAL NOT NULL,
    closed REAL,
    meta TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE TABLE IF NOT EXISTS commits (host TEXT PRIMARY KEY, started REAL NOT NULL);
CREATE TABLE IF NOT EXISTS id_slots (slot INTEGER PRIMARY KEY, family TEXT NOT NULL,
                                     taken REAL NOT NULL);
CREATE TABLE IF NOT EXISTS workspace_versions (host TEXT PRIMARY KEY,
                                               version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS launchers (pid INTEGER NOT NULL, started INTEGER NOT NULL,
                                      PRIMARY KEY (pid, started));
"""


@dataclass
class SandboxRecord:
    id: str
    family: str
    instance: str
    image: str
    parent_id: str | None = None
    state: str = "ready"  # ready | gone (REPL died) | closed
    created: float = field(default_factory=time.time)
    closed: float | None = None
    meta: dict = field(default_factory=dict)


KEEP_CLOSED = 1000
"""Rows of closed sandboxes kept (the most recently closed), for looking back; older ones
are deleted so a daemon's database does not grow by a row per fork for ever."""
_PRUNE_EVERY = 256  # closes between two prunes (one DELETE, amortized)


class Records:
    def __init__(self, path: Path) -> None:
        self._closed_since_prune = 0
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)

    def put(self, *recs: SandboxRecord) -> None:
        """Write these records in one transaction (all of them, or none)."""
        # Not dataclasses.asdict: it deep-copies meta (a fork's layer stack and all) only
        # for the copy to be dumped to JSON: a third of a warm create's bookkeeping.
        rows = [{**vars(rec), "meta": json.dumps(rec.meta)} for rec in recs]
        self.db.execute("BEGIN")  # explicit: the connection is in autocommit mode
        try:
            self.db.executemany(
                "INSERT OR REPLACE INTO sandboxes (id, parent_id, family, instance, state, "
                "image, created, closed, meta) VALUES (:id, :parent_id, :family, :instance, "
                ":state, :image, :created, :closed, :meta)", rows)
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def live(self) -> list[SandboxRecord]:
        rows = self.db.execute(
            "SELECT id, family, instance, image, parent_id, state, created, closed, meta "
            "FROM sandboxes WHERE state != 'closed'"
        ).fetchall()
        return [SandboxRecord(*row[:8], meta=json.loads(row[8])) for row in rows]

    def mark_closed(self, ids: list[str]) -> None:
        now = time.time()
        self.db.executemany(
            "UPDATE sandboxes SET state='closed', closed=? WHERE id=?", [(now, i) for i in ids]
        )
        self._closed_since_prune += len(ids)
        if self._closed_since_prune >= _PRUNE_EVERY:
            self._closed_since_prune = 0
            self.db.execute(
                "DELETE FROM sandboxes WHERE id IN (SELECT id FROM sandboxes WHERE "
                "state = 'closed' ORDER BY closed DESC LIMIT -1 OFFSET ?)", (KEEP_CLOSED,))

    def set_lineage(self, sandbox_id: str, parent_id: str, forked_at: int) -> None:
        """A merge made ``sandbox_id`` (live or closed) a branch of ``parent_id``."""
        self.db.execute("UPDATE sandboxes SET parent_id = ?, meta = json_set(meta, "
                        "'$.forked_at', ?) WHERE id = ?", (parent_id, forked_at, sandbox_id))

    def lineage(self) -> dict[str, tuple[str, int]]:
        """(parent, parent's generation at the fork) of every sandbox that has them."""
        rows = self.db.execute(
            "SELECT id, parent_id, json_extract(meta, '$.forked_at') FROM sandboxes "
            "WHERE parent_id IS NOT NULL AND json_extract(meta, '$.forked_at') IS NOT NULL "
            "AND state != 'checkpoint'").fetchall()
        return {sid: (parent, int(at)) for sid, parent, at in rows}

    def set_workspace_version(self, host: Path, version: int) -> None:
        """Commits into ``host`` so far (first commit wins among its branches)."""
        self.db.execute("INSERT OR REPLACE INTO workspace_versions VALUES (?, ?)",
                        (str(host), version))

    def workspace_versions(self) -> dict[Path, int]:
        return {Path(h): v for h, v in
                self.db.execute("SELECT host, version FROM workspace_versions")}

    def put_launcher(self, launcher: tuple[int, int]) -> None:
        """A family runs under this launcher (pid, start time): a restarted daemon
        re-attaches to it, or kills it if none of its sandboxes is kept."""
        self.db.execute("INSERT OR REPLACE INTO launchers VALUES (?, ?)", launcher)

    def drop_launcher(self, launcher: tuple[int, int]) -> None:
        self.db.execute("DELETE FROM launchers WHERE pid = ? AND started = ?", launcher)

    def launchers(self) -> list[tuple[int, int]]:
        return [tuple(row) for row in self.db.execute("SELECT pid, started FROM launchers")]

    def begin_commit(self, host: Path) -> None:
        """Note a workspace commit under way, so a daemon that dies inside it is followed
        by one that finishes or undoes it (storage.workspace_commit.recover)."""
        self.db.execute("INSERT OR REPLACE INTO commits VALUES (?, ?)", (str(host), time.time()))

    def end_commit(self, host: Path) -> None:
        self.db.execute("DELETE FROM commits WHERE host = ?", (str(host),))

    def pending_commits(self) -> list[Path]:
        return [Path(row[0]) for row in self.db.execute("SELECT host FROM commits")]

    def take_slot(self, slot: int, family: str) -> None:
        """Note that family ``family`` runs in (and its layers hold files of) id slot
        ``slot`` (see engine.idranges): a restarted daemon hands it out again only once
        nothing of that family is left."""
        self.db.execute("INSERT OR REPLACE INTO id_slots VALUES (?, ?, ?)",
                        (slot, family, time.time()))

    def free_slot(self, slot: int) -> None:
        self.db.execute("DELETE FROM id_slots WHERE slot = ?", (slot,))

    def slots(self) -> dict[int, str]:
        """Id slots taken, and by which family."""
        return dict(self.db.execute("SELECT slot, family FROM id_slots").fetchall())

    def close(self) -> None:
        self.db.close()
