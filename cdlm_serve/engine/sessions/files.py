"""A session on disk: versioned files, so that a crash at any moment leaves one complete version.

One folder per session, named by its id (ids are checked by `engine.sessions.store.check_id`, and
every path is checked to lie inside the store's root before it is touched):

    <root>/<id>/meta.json               the committed version: token history, next input token,
                                        compactions, and the KV segments that hold its cache
    <root>/<id>/kv-<generation>-<random>.safetensors
                                        immutable segments: slots [start, end) of every layer's
                                        keys and values (and biases, once compacted)

A write adds new segment files (each written to a temporary name, fsynced and renamed:
`stage`), then writes meta.json the same way and fsyncs the folder (`commit`); only after that
are the segments the new version no longer names removed (`finish`). The rename of meta.json is
the commit point: a crash before it leaves the old version whole (the new segment files are
orphans), a crash after it the new one. Until `finish`, a write can be taken back whole
(`abandon`: a full disk, or a shared tier that refused the new version after the local commit):
the replaced meta.json is kept as a hard link and renamed back, which needs no free space, and
the new files are removed. `write_version` does the three steps. Appending to a session (a
completion with `append`) writes only the new slots as one more segment; a compaction, which
changes every slot, writes one segment for all.
Start-up (`recover`) finishes what a crash interrupted: it removes temporary files and orphaned
segments, and a folder that never got its first meta.json (a create that was never answered).

Deleting renames the folder to `.trash-<id>-<random>` (the commit point; ids never start with a
dot, so it cannot clash with a session), fsyncs the root, then removes it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from cdlm_serve.engine.compaction import QuantizedSegment
from cdlm_serve.engine.sessions.segment_tensors import (
    cache_from_parts,
    segment_tensors,
)
from cdlm_serve.models.fetch import fsync_dir
from cdlm_serve.models.kv_cache import KVCache

log = logging.getLogger(__name__)

FORMAT = 2
META = "meta.json"
TRASH_PREFIX = ".trash-"
MAX_SEGMENTS = 16  # past this many appends, the next write merges them into one file


class CorruptSession(ValueError):
    """A committed session whose files do not match its meta.json (never written by us: the
    disk or a person changed them)."""


@dataclass(slots=True)
class Segment:
    file: str  # name inside the session's folder
    start: int  # physical slots [start, end)
    end: int
    bytes: int  # file size, checked at start-up


@dataclass(slots=True)
class Version:
    """What meta.json says: everything about a session but its tensors."""

    id: str
    model: str
    tokens: list[int]
    next_input: int | None
    compactions: list[dict[str, Any]]
    created: float
    length: int  # physical slots of the cache (0: no cache yet)
    logical: int  # logical length of the cache (RoPE position of the next token)
    generation: int
    segments: list[Segment]
    # A random id of this commit: two replicas that each committed generation N of one session
    # (one of them never got it into the shared tier) are told apart by it.
    commit: str = ""
    # The session's online compaction policy (`engine.compaction.auto.AutoCompact`), if any.
    auto_compact: dict[str, Any] | None = None
    # The Responses API's record of the response this session is (server/routes/responses.py).
    response: dict[str, Any] | None = None

    @property
    def disk_bytes(self) -> int:
        return sum(s.bytes for s in self.segments)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Version:
        segments = [Segment(**s) for s in obj["segments"]]
        return cls(
            id=str(obj["id"]),
            model=str(obj["model"]),
            tokens=[int(t) for t in obj["tokens"]],
            next_input=None if obj.get("next_input") is None else int(obj["next_input"]),
            compactions=list(obj.get("compactions", [])),
            created=float(obj["created"]),
            length=int(obj["length"]),
            logical=int(obj["logical"]),
            generation=int(obj["generation"]),
            segments=segments,
            commit=str(obj.get("commit", "")),
            auto_compact=obj.get("auto_compact"),
            response=obj.get("response"),
        )


# ---- low-level atomic writes -------------------------------------------------------------------
def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


def _write_json(obj: Any, path: Path) -> None:
    tmp = _tmp_name(path)
    try:
        with tmp.open("w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_segment(
    cache: KVCache, start: int, end: int, path: Path, codes: QuantizedSegment | None = None
) -> Segment:
    """Slots [start, end) of row 0 of `cache` into one safetensors file (`segment_tensors`)."""
    tensors = {name: t.cpu() for name, t in segment_tensors(cache, start, end, codes).items()}
    # Serialized in memory and written by Python's file API, not safetensors' `save_file`:
    # a full disk is then an OSError with its errno (ENOSPC, EFBIG, EDQUOT), which the server
    # answers 507, not safetensors' own exception type.
    data = save(tensors, metadata={"start": str(start), "end": str(end)})
    del tensors
    tmp = _tmp_name(path)
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Segment(path.name, start, end, len(data))


# ---- versions ----------------------------------------------------------------------------------
@dataclass(slots=True)
class PendingVersion:
    """A version on its way to disk: its new files are written (`stage`), its meta.json maybe
    too (`commit`); until `finish`, `abandon` takes it all back."""

    folder: Path
    version: Version
    new_files: list[str]  # segment files this write added (written, or linked from a fork's)
    new_folder: bool  # the folder did not exist before this write
    previous: Path | None = None  # once committed: a hard link to the meta.json it replaced
    committed: bool = False


def write_version(
    folder: Path,
    version: Version,
    cache: KVCache | None,
    keep_slots: int,
    codes: QuantizedSegment | None = None,
    link_from: Path | None = None,
) -> Version:
    """`stage`, `commit` and `finish` a version (see `stage`); a write that fails leaves the
    folder as it was. Returns the committed version."""
    pending = stage(folder, version, cache, keep_slots, codes, link_from)
    try:
        commit(pending)
    except BaseException:
        abandon(pending)
        raise
    return finish(pending)


def stage(
    folder: Path,
    version: Version,
    cache: KVCache | None,
    keep_slots: int,
    codes: QuantizedSegment | None = None,
    link_from: Path | None = None,
) -> PendingVersion:
    """Write the files of `version` (its tokens and metadata; `segments` and `generation` are
    filled in here) with the cache's slots: the first `keep_slots` are already on disk in
    `version`'s current segments and unchanged, the rest are written as a new segment (the
    cache's first slots as `codes`' int8, in a segment of their own, where the session holds
    codes). With `link_from`, the first commit of a fork: `version`'s segments are another
    session's files in that folder, hard-linked into this one (segments are immutable, so the
    two share their bytes); if one cannot be linked (gone meanwhile, or a filesystem without
    links), every slot is written from the cache instead. Nothing is committed yet: a failure
    here removes what it wrote. The caller holds the session's lock."""
    new_folder = not folder.exists()
    if new_folder:
        folder.mkdir()
        fsync_dir(folder.parent)
    pending = PendingVersion(folder, version, [], new_folder)
    try:
        pending.version = _write_files(pending, cache, keep_slots, codes, link_from)
    except BaseException:
        abandon(pending)
        raise
    return pending


def _write_files(
    pending: PendingVersion,
    cache: KVCache | None,
    keep_slots: int,
    codes: QuantizedSegment | None,
    link_from: Path | None,
) -> Version:
    """`stage`'s files; the version they make (each new file named in `pending` as soon as it
    exists, so that `abandon` finds it)."""
    folder, version = pending.folder, pending.version
    if (
        link_from is not None
        and keep_slots > 0
        and len(version.segments) < MAX_SEGMENTS  # else merged into one new file below
        and not _linked(link_from, folder, version.segments, pending.new_files)
    ):
        keep_slots = 0
    generation = version.generation + 1
    length = 0 if cache is None else cache.lengths[0]
    segments = list(version.segments)
    if cache is not None:
        if keep_slots > length or keep_slots != sum(s.end - s.start for s in segments):
            keep_slots = 0  # not a pure append: write everything
        if keep_slots == 0 or len(segments) >= MAX_SEGMENTS:
            segments, keep_slots = [], 0

        def path() -> Path:  # unique: a segment is never replaced by other bytes under its name
            name = f"kv-{generation}-{uuid.uuid4().hex[:12]}.safetensors"
            pending.new_files.append(name)  # before it exists: a failed write's is removed
            return folder / name

        if codes is not None and keep_slots < codes.slots:
            segments = [_write_segment(cache, 0, codes.slots, path(), codes)]
            keep_slots = codes.slots
        if length > keep_slots:
            segments.append(_write_segment(cache, keep_slots, length, path()))
    else:
        segments = []
    return Version(
        id=version.id,
        model=version.model,
        tokens=list(version.tokens),
        next_input=version.next_input,
        compactions=list(version.compactions),
        created=version.created,
        length=length,
        logical=0 if cache is None else cache.logical[0],
        generation=generation,
        segments=segments,
        commit=uuid.uuid4().hex,
        auto_compact=version.auto_compact,
        response=version.response,
    )


def commit(pending: PendingVersion) -> None:
    """Write the staged version's meta.json (the commit point), keeping the one it replaces
    as a hard link under a temporary name until `finish` or `abandon`."""
    meta = pending.folder / META
    if meta.exists():
        previous = _tmp_name(meta)
        os.link(meta, previous)
        pending.previous = previous
    _write_json(pending.version.to_json(), meta)
    pending.committed = True
    fsync_dir(pending.folder)


def finish(pending: PendingVersion) -> Version:
    """The staged and committed version is final: the files it does not name go (the
    replaced meta.json among them). Returns it."""
    _remove_unreferenced(pending.folder, pending.version)
    return pending.version


def abandon(pending: PendingVersion) -> None:
    """Take a write back: the replaced meta.json renamed back (if it was committed), the new
    files removed; a folder this write made is removed whole. Best effort (the failure being
    handled is the one to report): what it cannot remove, start-up's `recover` does."""
    folder = pending.folder
    try:
        if pending.new_folder:
            shutil.rmtree(folder, ignore_errors=True)
            return
        if pending.committed:
            if pending.previous is not None:
                os.replace(pending.previous, folder / META)
            else:  # nothing was committed before: the folder holds no version again
                (folder / META).unlink(missing_ok=True)
            fsync_dir(folder)
        elif pending.previous is not None:
            pending.previous.unlink(missing_ok=True)
        for name in pending.new_files:
            (folder / name).unlink(missing_ok=True)
    except OSError as e:
        log.error("could not take back a failed write of %s: %s", folder, e)


def _linked(source: Path, folder: Path, segments: list[Segment], made: list[str]) -> bool:
    """Hard-link the segment files from `source` into `folder`, naming each in `made` (False
    if one cannot be)."""
    try:
        for seg in segments:
            made.append(seg.file)
            os.link(source / seg.file, folder / seg.file)
    except OSError as e:
        log.info("could not link the segments of %s into %s (%s): writing them", source, folder, e)
        return False
    return True


def read_version(folder: Path, expect_id: str | None = None) -> Version:
    """The committed version of a session folder (of session `expect_id`: by default the
    folder's name); CorruptSession if its files disagree."""
    try:
        obj = json.loads((folder / META).read_text())
        if obj.get("format") != FORMAT:
            raise CorruptSession(f"unknown session format {obj.get('format')!r}")
        version = Version.from_json(obj)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptSession(f"{folder / META}: {e}") from None
    if version.id != (expect_id or folder.name):
        raise CorruptSession(f"{folder} holds session {version.id!r}")
    covered = 0
    for seg in version.segments:
        path = folder / seg.file
        if seg.start != covered or not path.is_file() or path.stat().st_size != seg.bytes:
            raise CorruptSession(f"{path} is missing or does not match {META}")
        covered = seg.end
    if covered != version.length:
        raise CorruptSession(f"{folder}: segments cover {covered} of {version.length} slots")
    return version


def read_cache(
    folder: Path, version: Version, device: torch.device, dtype: torch.dtype
) -> tuple[KVCache | None, QuantizedSegment | None]:
    """The session's cache, its segments concatenated (None if it has none), and the int8
    codes its first segment holds (None if it holds plain tensors); ragged layers padded back
    (masked slots: zero keys and values, a -inf bias)."""
    if not version.segments:
        return None, None
    parts: list[dict[str, torch.Tensor]] = []
    for seg in version.segments:
        with safe_open(str(folder / seg.file), framework="pt") as f:
            parts.append({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return cache_from_parts(parts, version.length, version.logical, device, dtype)


def _remove_unreferenced(folder: Path, version: Version) -> None:
    """Segment and temporary files the committed version does not name."""
    keep = {META, *(s.file for s in version.segments)}
    for path in folder.iterdir():
        if path.name not in keep and (path.suffix in (".safetensors", ".tmp")):
            path.unlink(missing_ok=True)


# ---- whole folders -----------------------------------------------------------------------------
def recover(folder: Path) -> Version | None:
    """Finish what a crash interrupted in one session folder: the committed version (orphans
    and temporary files removed), or None for a folder whose first version was never
    committed (removed). CorruptSession for a committed version whose files are damaged; that
    folder is left as it is, for a person to look at."""
    if not (folder / META).exists():
        unknown = [
            p.name
            for p in folder.iterdir()
            if not p.name.endswith(".tmp")
            and not (p.name.startswith("kv-") and p.suffix == ".safetensors")
        ]
        if unknown:
            raise CorruptSession(f"{folder} has no {META} but holds {unknown[:3]}")
        shutil.rmtree(folder)
        return None
    version = read_version(folder)
    _remove_unreferenced(folder, version)
    return version


SEGMENT_NAME = re.compile(r"kv-[0-9]{1,18}(-[0-9a-f]{12})?\.safetensors")


def install(folder: Path, meta: bytes, files: dict[str, bytes]) -> Version:
    """Put a version that was committed elsewhere (the shared tier) in `folder`, replacing
    what is there. Its files go to a staging folder under a trash name (removed at start-up if
    a crash stops us) and are checked whole there; then the old folder moves aside (a trash
    name too), the staging folder takes its place, and the old one is removed. A crash between
    the renames leaves no local copy, and the shared one is still there to fetch again.
    CorruptSession, with the local copy untouched, if the files do not make a whole version of
    this session."""
    staging = folder.with_name(f"{TRASH_PREFIX}fetch-{folder.name}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        if not all(SEGMENT_NAME.fullmatch(name) for name in files):
            raise CorruptSession(f"{folder.name}: unexpected file names {sorted(files)[:3]}")
        for name, blob in files.items():
            (staging / name).write_bytes(blob)
            _fsync_file(staging / name)
        (staging / META).write_bytes(meta)
        _fsync_file(staging / META)
        fsync_dir(staging)
        version = read_version(staging, expect_id=folder.name)
        old = folder.with_name(f"{TRASH_PREFIX}{folder.name}-{uuid.uuid4().hex[:8]}")
        if folder.exists():
            os.replace(folder, old)
        os.replace(staging, folder)
        fsync_dir(folder.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return version


def trash(folder: Path) -> None:
    """Delete a session folder: one rename (the commit point), then the removal."""
    if not folder.exists():
        return
    doomed = folder.with_name(f"{TRASH_PREFIX}{folder.name}-{uuid.uuid4().hex[:8]}")
    os.replace(folder, doomed)
    fsync_dir(folder.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def empty_trash(root: Path) -> None:
    for doomed in root.glob(f"{TRASH_PREFIX}*"):
        shutil.rmtree(doomed, ignore_errors=True)
