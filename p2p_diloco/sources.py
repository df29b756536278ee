"""Where documents come from: Python's own prose (offline), local files, or a hub dataset (streaming).

Inputs:  a DataConfig (``source``, ``path``, ``text_field``, ``label_field``, ``max_documents``, hub fields).
Output:  ``load_documents(cfg) -> list[Document]``: non-empty texts with a label, in a fixed order.
         ``offline``: the language reference (``pydoc_data.topics``) and stdlib docstrings, 7 labels by area;
         ``files``: .txt/.jsonl/.json/.parquet through ``datasets``; ``hub``: ``datasets.load_dataset(...,
         streaming=True)``, the first ``max_documents`` records. See data.py for the whole pipeline.
State:   the offline corpus is cached per process.
Failure: DataError naming the problem and the fix (path not found, unknown file type, missing field, hub
         without max_documents or unreachable).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import gc
import glob
import os
import re
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2p_diloco.config import DataConfig

__all__ = ["DataError", "Document", "load_documents"]

_FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_DOC_CHARS = 1500  # target document size when splitting long offline texts
_AREAS = {  # top-level stdlib module -> label; anything unlisted is "other"
    "text-and-data": "re sre_compile sre_constants sre_parse string stringprep textwrap difflib codecs "
    "json csv html xml _markupbase pickle pickletools _compat_pickle copyreg shelve dbm sqlite3 configparser "
    "tomllib plistlib netrc struct base64 quopri uu xdrlib gettext locale _strptime datetime calendar "
    "zoneinfo decimal _pydecimal fractions numbers statistics random colorsys collections _collections_abc "
    "heapq bisect graphlib enum dataclasses copy pprint reprlib weakref _weakrefset types operator functools "
    "hashlib hmac secrets",
    "networking": "email http urllib nturl2path ftplib imaplib poplib nntplib smtplib smtpd telnetlib socket "
    "socketserver ssl xmlrpc wsgiref cgi cgitb mimetypes mailbox mailcap ipaddress uuid webbrowser asynchat "
    "asyncore",
    "os-and-files": "os posixpath ntpath genericpath shutil tempfile pathlib glob fnmatch fileinput filecmp "
    "linecache stat tarfile zipfile zipimport zipapp gzip bz2 lzma _compression io _pyio platform sysconfig "
    "site _sitebuiltins getpass pty tty shlex curses chunk imghdr sndhdr _aix_support _osx_support",
    "concurrency": "threading _threading_local multiprocessing concurrent asyncio subprocess _bootsubprocess "
    "sched queue signal selectors contextvars",
    "dev-tools": "unittest doctest pdb bdb inspect traceback typing ast dis opcode token tokenize keyword "
    "symtable timeit cProfile profile pstats trace tracemalloc pydoc importlib imp pkgutil modulefinder "
    "runpy code codeop argparse optparse getopt logging warnings distutils ensurepip venv compileall py_compile "
    "tabnanny pyclbr rlcompleter contextlib abc _py_abc __future__",
}
_AREA_OF = {mod: area for area, mods in _AREAS.items() for mod in mods.split()}
_SKIP_DIRS = {
    "test",
    "tests",
    "idle_test",
    "idlelib",
    "lib2to3",
    "turtledemo",
    "pydoc_data",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "_bundled",
    "encodings",
}  # encodings: codec tables, no prose


class DataError(ValueError):
    """Bad data setup; the message names the problem and what to do about it."""


@dataclass(frozen=True)
class Document:
    text: str
    label: str


def _chunk(text: str, target: int = _DOC_CHARS) -> list[str]:
    """Split ``text`` at blank lines (then lines) into pieces of about ``target`` to ``2 * target`` chars."""
    pieces: list[str] = []
    for para in re.split(r"\n\s*\n", text.strip()):
        pieces += para.splitlines() if len(para) > 2 * target else [para]
    out, cur = [], ""
    for piece in pieces:
        cur = f"{cur}\n\n{piece}" if cur else piece
        if len(cur) >= target:
            out.append(cur)
            cur = ""
    if out and len(cur) < target // 4:  # a short tail joins the previous piece
        out[-1], cur = f"{out[-1]}\n\n{cur}", ""
    out.append(cur)
    return [c.strip() for c in out if c.strip()]


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    found, todo = [], [tree]
    while todo:  # statements only (ast.walk over every expression node is 3x slower)
        node = todo.pop()
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            found.append((getattr(node, "lineno", 0), ast.get_docstring(node) or ""))
        for name in ("body", "orelse", "finalbody", "handlers"):
            todo += [n for n in getattr(node, name, ()) if isinstance(n, ast.stmt | ast.excepthandler)]
    return [doc for _, doc in sorted(found) if len(doc) > 200]


@functools.lru_cache(maxsize=1)
def _offline_corpus() -> tuple[Document, ...]:
    """Language-reference topics and stdlib docstrings, chunked, deduplicated; cached per process (~1.5 s)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split pydoc_data out; the docstrings still suffice
        topics = {}
    docs = [Document(c, "language-reference") for name in sorted(topics) for c in _chunk(topics[name])]
    stdlib, gc_was_on = Path(sysconfig.get_paths()["stdlib"]), gc.isenabled()
    gc.disable()  # big ASTs set off needless cyclic collections: this halves the build time
    try:
        for root, dirs, files in os.walk(stdlib):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("test"))
            for name in sorted(f for f in files if f.endswith(".py") and not f.startswith("test")):
                top = Path(root, name).relative_to(stdlib).parts[0].removesuffix(".py")
                text = "\n\n".join(_docstrings(Path(root, name)))
                docs += [Document(c, _AREA_OF.get(top, "other")) for c in _chunk(text)] if text else []
    finally:
        if gc_was_on:
            gc.enable()
    seen: set[str] = set()
    return tuple(d for d in docs if not (d.text in seen or seen.add(d.text)))


def _files(path: str) -> list[Path]:
    p = Path(path).expanduser()
    if p.is_file():
        found = [p]
    elif p.is_dir():
        found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in _FILE_BUILDERS)
        if not found:
            raise DataError(f"directory {path!r} holds no {'/'.join(_FILE_BUILDERS)} files")
    else:
        matches = glob.glob(os.path.expanduser(path), recursive=True)
        found = sorted(Path(f) for f in matches if Path(f).is_file())
        if not found:
            raise DataError(f"data.path {path!r} not found: give an existing file, directory or glob")
    for f in found:
        if f.suffix.lower() not in _FILE_BUILDERS:
            raise DataError(
                f"unknown file type {f.suffix or '(none)'!r} for {str(f)!r}: data.source=files "
                f"reads {', '.join(_FILE_BUILDERS)}"
            )
    return found


def _records_to_docs(
    records: Iterable[dict[str, Any]], cfg: DataConfig, where: str, default_label: str, docs: list[Document]
) -> None:
    """Append one Document per record with non-empty text, stopping at cfg.max_documents."""
    for rec in records:
        if cfg.max_documents is not None and len(docs) >= cfg.max_documents:
            return
        for name in (cfg.text_field, cfg.label_field):
            if name is not None and name not in rec:
                raise DataError(
                    f"no field {name!r} in {where} (fields: {', '.join(sorted(rec))}); set "
                    f"data.{'text' if name == cfg.text_field else 'label'}_field"
                )
        text = rec[cfg.text_field]
        if text is not None and not isinstance(text, str):
            raise DataError(f"field {cfg.text_field!r} in {where} holds {type(text).__name__}, not text")
        if text and text.strip():
            label = default_label if cfg.label_field is None else str(rec[cfg.label_field])
            docs.append(Document(text.strip(), label))


def _load_files(cfg: DataConfig) -> list[Document]:
    import datasets

    docs: list[Document] = []
    for f in _files(str(cfg.path)):
        builder = _FILE_BUILDERS[f.suffix.lower()]
        extra = {"sample_by": "paragraph"} if builder == "text" else {}
        fields = dataclasses.replace(cfg, text_field="text", label_field=None) if builder == "text" else cfg
        try:
            ds = datasets.load_dataset(builder, data_files=str(f), split="train", streaming=True, **extra)
            _records_to_docs(ds, fields, f"file {str(f)!r}", f.stem, docs)
        except DataError:
            raise
        except Exception as exc:  # malformed json/parquet surfaces as assorted datasets/pyarrow errors
            raise DataError(f"could not read {str(f)!r} as {builder}: {type(exc).__name__}: {exc}") from exc
    return docs


def _load_hub(cfg: DataConfig) -> list[Document]:
    import datasets

    if cfg.max_documents is None:
        raise DataError(
            f"data.source=hub streams {cfg.path!r}, which may be huge: set data.max_documents "
            "(e.g. data.max_documents=20000)"
        )
    where = f"hub dataset {cfg.path!r} (config {cfg.hub_config!r}, split {cfg.hub_split!r})"
    docs: list[Document] = []
    try:
        ds = datasets.load_dataset(str(cfg.path), cfg.hub_config, split=cfg.hub_split, streaming=True)
        _records_to_docs(ds, cfg, where, str(cfg.path).rstrip("/").split("/")[-1], docs)
    except DataError:
        raise
    except Exception as exc:
        chain = " ".join(f"{type(e).__name__} {e}" for e in (exc, exc.__cause__, exc.__context__) if e)
        network = isinstance(exc, ConnectionError | TimeoutError) or re.search("Connect|Timeout|Offline|reach", chain)
        problem = "could not reach the Hugging Face hub for" if network else "could not load"
        raise DataError(
            f"{problem} {where}: {type(exc).__name__}: {exc}. Without network use "
            "data.source=offline, or download the data and set data.source=files and data.path "
            "to its local path"
        ) from exc
    return docs


def load_documents(cfg: DataConfig) -> list[Document]:
    """The source's documents in a fixed order; DataError when there are none."""
    if cfg.source == "offline":
        docs = list(_offline_corpus())
        if cfg.max_documents is not None and cfg.max_documents < len(docs):
            docs = [docs[i * len(docs) // cfg.max_documents] for i in range(cfg.max_documents)]
    elif cfg.source == "files":
        docs = _load_files(cfg)
    elif cfg.source == "hub":
        docs = _load_hub(cfg)
    else:
        raise DataError(f"data.source={cfg.source!r} is unknown: use offline, files or hub")
    if not docs:
        raise DataError(f"data.source={cfg.source!r} (path {cfg.path!r}) yielded no non-empty documents")
    return docs
