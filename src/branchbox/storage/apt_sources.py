"""Where the host gets its Debian packages from: the mirror and keyring an image build uses.

An image build must fetch from wherever this machine's apt fetches: a host
behind a local mirror, a caching proxy or an air-gapped archive then builds
images unchanged, and no package host name is baked into branchbox. This
module reads the host's apt sources (one-line ``*.list`` files and deb822
``*.sources`` files) and picks the Debian archive that serves a given suite.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

APT_ETC = Path("/etc/apt")


@dataclass(frozen=True)
class AptSource:
    """One ``deb`` entry: an archive URI, its suites and components, and its keyring."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]
    signed_by: str | None = None  # a keyring file, if the entry names one
    origin: str = field(default="", compare=False)  # the file it came from, for messages


@dataclass(frozen=True)
class Mirror:
    """What debootstrap needs: the archive URI and, if the host pins one, the keyring."""

    uri: str
    keyring: str | None
    origin: str


class NoMirror(LookupError):
    """The host's apt sources name no archive for the suite; the message says what was read."""


def read_sources(etc: Path = APT_ETC) -> list[AptSource]:
    """Every enabled ``deb`` entry of ``etc``/sources.list and sources.list.d, in apt's order."""
    files: list[Path] = []
    if (etc / "sources.list").is_file():
        files.append(etc / "sources.list")
    parts = etc / "sources.list.d"
    if parts.is_dir():
        files += sorted(p for p in parts.iterdir() if p.suffix in (".list", ".sources"))
    found: list[AptSource] = []
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        parse = parse_deb822 if path.suffix == ".sources" else parse_one_line
        found += parse(text, str(path))
    return found


_OPTIONS = re.compile(r"^\[([^\]]*)\]\s*")


def parse_one_line(text: str, origin: str = "") -> list[AptSource]:
    """``deb [opt=val ...] URI SUITE [COMPONENT...]`` lines; deb-src and comments ignored."""
    found = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line.startswith("deb ") and not line.startswith("deb\t"):
            continue
        rest = line[3:].strip()
        options: dict[str, str] = {}
        match = _OPTIONS.match(rest)
        if match:
            for item in match[1].split():
                key, _, value = item.partition("=")
                options[key.lower()] = value
            rest = rest[match.end():]
        words = rest.split()
        if len(words) < 2:
            continue
        found.append(AptSource(words[0], (words[1],), tuple(words[2:]),
                               options.get("signed-by") or None, origin))
    return found


def parse_deb822(text: str, origin: str = "") -> list[AptSource]:
    """Stanzas of ``Types``/``URIs``/``Suites``/``Components``/``Signed-By`` fields.

    ``Enabled: no`` stanzas are skipped. A ``Signed-By`` holding an inline key
    (a multi-line field) names no file, so the entry gets no keyring (debootstrap
    then checks against its default one).
    """
    found = []
    for stanza in _stanzas(text):
        if stanza.get("enabled", "yes").strip().lower() == "no":
            continue
        if "deb" not in stanza.get("types", "").split():
            continue
        signed = stanza.get("signed-by", "").strip()
        keyring = signed if signed and "\n" not in signed and signed.startswith("/") else None
        for uri in stanza.get("uris", "").split():
            found.append(AptSource(uri, tuple(stanza.get("suites", "").split()),
                                   tuple(stanza.get("components", "").split()), keyring, origin))
    return found


def _stanzas(text: str) -> list[dict[str, str]]:
    """deb822 paragraphs as {lower-case field: value}; continuation lines join the value."""
    stanzas: list[dict[str, str]] = []
    current: dict[str, str] = {}
    key = None
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if current:
                stanzas.append(current)
            current, key = {}, None
            continue
        if raw[0] in " \t" and key is not None:
            current[key] += "\n" + raw.strip()
            continue
        name, sep, value = raw.partition(":")
        if not sep:
            continue
        key = name.strip().lower()
        current[key] = value.strip()
    if current:
        stanzas.append(current)
    return stanzas


def _fetchable(uri: str) -> bool:
    """debootstrap fetches http(s), ftp and file URIs; apt-only schemes (mirror+, cdrom:) not."""
    return uri.split(":", 1)[0] in ("http", "https", "ftp", "file")


def mirror_for(suite: str, sources: list[AptSource] | None = None, *,
               same_archive_ok: bool | None = None) -> Mirror:
    """The host's archive for ``suite`` with component ``main``.

    An entry listing ``suite`` itself wins. Failing that (a host on another
    release), an entry of the host's own Debian archive (a release suite or its
    -updates/-backports, never -security, which is a different archive) is taken:
    a Debian mirror serves every suite. That fallback is only for a Debian host
    (``same_archive_ok``, by default: /etc/os-release says ID=debian), since another
    distribution's archive does not carry Debian suites.
    """
    if sources is None:
        sources = read_sources()
    usable = [s for s in sources
              if _fetchable(s.uri) and (not s.components or "main" in s.components)]
    for source in usable:
        if suite in source.suites:
            return Mirror(source.uri.rstrip("/"), source.signed_by, source.origin)
    if same_archive_ok is None:
        same_archive_ok = _host_is_debian()
    if same_archive_ok:
        for source in usable:
            if any(not s.endswith("-security") and "/" not in s for s in source.suites):
                return Mirror(source.uri.rstrip("/"), source.signed_by, source.origin)
    read = sorted({s.origin for s in sources if s.origin}) or ["no sources files"]
    raise NoMirror(
        f"the host's apt sources name no archive with suite {suite!r} and component main "
        f"(read: {', '.join(read)}); add one to /etc/apt/sources.list.d/ "
        f"(e.g. a deb822 file with 'Types: deb', 'URIs: <your Debian mirror>', "
        f"'Suites: {suite}', 'Components: main')"
    )


def _host_is_debian(os_release: Path = Path("/etc/os-release")) -> bool:
    try:
        text = os_release.read_text(errors="replace")
    except OSError:
        return False
    return re.search(r"^ID=\"?debian\"?\s*$", text, re.M) is not None


def apt_proxy_env() -> dict[str, str]:
    """``http_proxy``/``https_proxy`` from the host's apt configuration (Acquire::http::Proxy),
    for debootstrap, which reads the environment and not apt.conf. Empty if none or no apt."""
    env: dict[str, str] = {}
    for scheme in ("http", "https"):
        try:
            out = subprocess.run(
                ["apt-config", "shell", "P", f"Acquire::{scheme}::Proxy"],
                capture_output=True, text=True, timeout=10, check=False,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return env
        match = re.match(r"P='([^']*)'", out.strip())
        if match and match[1] and match[1].upper() != "DIRECT":
            env[f"{scheme}_proxy"] = match[1]
    for name in ("http_proxy", "https_proxy", "no_proxy"):
        if os.environ.get(name):
            env[name] = os.environ[name]  # the caller's own setting wins
    return env
