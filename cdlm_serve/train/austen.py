"""Jane Austen's six novels, offline: Debian's `r-cran-janeaustenr` package.

The package stores each novel as an R character vector (one element per printed line) inside
R's lazy-load database (`data/Rdata.rdb`, zlib-compressed serialized objects indexed by
`Rdata.rdx`). We fetch the .deb with `apt-get download`, unpack it with `dpkg -x` (nothing is
installed), read the vectors with the PyPI `rdata` package, and cache one UTF-8 text file per
novel: paragraphs joined, one per line.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

from cdlm_serve.models.fetch import serve_home

NOVELS = (
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
)
PACKAGE = "r-cran-janeaustenr"


class AustenError(RuntimeError):
    pass


def data_dir(home: Path | None = None) -> Path:
    return (home or serve_home()) / "data" / "austen"


def load(novel: str, home: Path | None = None) -> str:
    """The novel's text, paragraphs separated by newlines (fetched and cached on first use)."""
    if novel not in NOVELS:
        raise ValueError(f"unknown novel {novel!r}; known: {', '.join(NOVELS)}")
    folder = data_dir(home)
    path = folder / f"{novel}.txt"
    if not path.is_file():
        _fetch(folder)
    return path.read_text(encoding="utf-8")


def _fetch(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        work = Path(tmp)
        proc = subprocess.run(
            ["apt-get", "download", PACKAGE], cwd=work, capture_output=True, text=True
        )
        debs = list(work.glob("*.deb"))
        if proc.returncode != 0 or not debs:
            raise AustenError(f"apt-get download {PACKAGE} failed: {proc.stderr[-1000:]}")
        subprocess.run(["dpkg", "-x", str(debs[0]), str(work / "x")], check=True)
        (data,) = list((work / "x").rglob("janeaustenr/data"))
        texts = _read_rdb(data / "Rdata.rdx", data / "Rdata.rdb")
        for novel in NOVELS:
            tmp_file = work / f"{novel}.txt"
            tmp_file.write_text(_paragraphs(texts[novel]), encoding="utf-8")
            os.replace(tmp_file, folder / f"{novel}.txt")  # atomic: never a half-written novel
        shutil.rmtree(work / "x")


def _read_rdb(index: Path, database: Path) -> dict[str, list[str]]:
    import rdata

    variables = rdata.read_rds(index)["variables"]
    raw = database.read_bytes()
    out = {}
    for name, (offset, length) in variables.items():
        blob = raw[int(offset) : int(offset) + int(length)]
        # Each object: a 4-byte big-endian uncompressed length, then a zlib stream.
        size = struct.unpack(">I", blob[:4])[0]
        payload = zlib.decompress(blob[4:])
        if len(payload) != size:
            raise AustenError(f"{name}: corrupt lazy-load entry")
        parsed = rdata.parser.parse_data(payload)
        out[str(name)] = [str(line) for line in rdata.conversion.convert(parsed)]
    return out


def _paragraphs(lines: list[str]) -> str:
    paras, current = [], []
    for line in lines:
        if line.strip():
            current.append(line.strip())
        elif current:
            paras.append(" ".join(current))
            current = []
    if current:
        paras.append(" ".join(current))
    return "\n".join(paras) + "\n"
