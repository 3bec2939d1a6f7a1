"""Where specgraph writes: it replaces only what it made, atomically, and never its own input.

Every command and API call that writes (`compile`'s bundle, `train`'s heads file and generation
cache, `bench`'s and `advise`'s JSON reports and plots) calls `check_output` before its long
work starts and `replace_dir` / `write_file` at the end, which check again. The rule:

- a path that does not exist is fine; missing parent folders are created when writing;
- an existing path is replaced only if specgraph made it, as this kind of output (`_NOT_OURS`): a
  bundle folder whose manifest.json has a `format_version` and lists every file in the folder; a
  heads, drafter or adapter file whose safetensors header carries one of specgraph's formats; a bench report (JSON with
  `aggregate` and `per_prompt`, or `sets`); an advise report (JSON with `advice` and `sets`); a
  bench or advise plot (PNG whose Software text names the command); train's generation cache
  (JSON with `key` and `sequences`) and feature cache (safetensors with specgraph's features format);
- an empty folder may receive a bundle;
- `force` also replaces an existing folder (bundle) or file (the file outputs) that specgraph did
  not make;
- never, even with `force`: a symbolic link; a path equal to, inside, or holding one of the
  command's inputs; the working directory or a folder holding it; the home folder; a folder where
  a file goes or a file where a folder goes; a path below a file.

Replacement is atomic: the new bundle or file is written completely beside the old one (hidden
`.NAME.specgraph-*` names in the same folder) and then renamed into place; an old folder is moved
aside first and deleted only after the new one is in place.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from specgraph.errors import OutputError

BUNDLE = "bundle"  # a folder
HEADS = "heads file"
BENCH_JSON = "bench report"
ADVICE_JSON = "advice report"
PLOT = "plot"
GEN_CACHE = "generation cache"
FEATURE_CACHE = "feature cache"
_FOLDERS = (BUNDLE,)
_MAX_READ = 64 << 20  # a file specgraph made is far smaller; anything larger is not ours
_MAX_ENTRIES = 10_000  # a bundle holds a handful of files
_PNG = b"\x89PNG\r\n\x1a\n"
PLOT_SOFTWARE = "specgraph bench"  # the PNG Software text that marks a plot as ours
ADVICE_PLOT_SOFTWARE = "specgraph advise"  # the same for an advise plot
_PLOT_MARKS = (PLOT_SOFTWARE, ADVICE_PLOT_SOFTWARE)

Inputs = Iterable[str | Path | None]


def check_output(path: str | Path, kind: str, inputs: Inputs = (), force: bool = False) -> Path:
    """The absolute path to write `kind` to; OutputError (one line) if the rule forbids it.

    `inputs` are the paths the command reads (missing ones and names like "smollm2-135m" are
    skipped); the output may not be one of them, lie inside one, or hold one."""
    target = _absolute(path)
    shown = str(path)
    if os.path.islink(target):
        raise OutputError(f"{shown} is a symbolic link; give the real path")
    cwd = Path.cwd().resolve()
    if cwd == target or cwd.is_relative_to(target):
        raise OutputError(f"{shown} is the working directory or holds it; give a new path")
    if target == Path.home().resolve() or target.parent == target:
        raise OutputError(f"{shown} is {'the home folder' if target.parent != target else 'the root'}; give a new path")
    for raw in inputs:
        _check_not_input(target, shown, raw)
    _check_parent(target, shown)
    if not os.path.lexists(target):
        return target
    folder = kind in _FOLDERS
    if target.is_dir() != folder:
        what = "a folder" if target.is_dir() else "a file"
        raise OutputError(f"{shown} is {what}, but the {kind} is {'a folder' if folder else 'a file'}; give a new path")
    if folder and not any(target.iterdir()):
        return target  # an empty folder takes the bundle
    why = _NOT_OURS[kind](target)
    if why is not None and not force:
        raise OutputError(
            f"refusing to replace {shown}, which specgraph did not make ({why}); give a new path, or --force to replace it"
        )
    return target


def staging_dir(target: Path) -> Path:
    """A fresh hidden folder beside `target`, to build a bundle in before `replace_dir`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.specgraph-", dir=target.parent))
    staging.chmod(0o777 & ~_UMASK)
    return staging


def replace_dir(staging: Path, target: Path, inputs: Inputs = (), force: bool = False) -> None:
    """Put the complete bundle `staging` at `target`, replacing what the rule allows."""
    check_output(target, BUNDLE, inputs, force)  # again: the path may have changed during the work
    _swap_in(staging, target)


def write_file(target: Path, write: Callable[[Path], Any], kind: str, inputs: Inputs = (), force: bool = False) -> Path:
    """`write(tmp)` writes the whole file to a hidden name beside `target`; it then replaces `target`."""
    target = check_output(target, kind, inputs, force)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.specgraph-", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        tmp.chmod(0o666 & ~_UMASK)
        write(tmp)
        tmp.chmod(0o666 & ~_UMASK)  # a writer that makes the file anew (safetensors) leaves mkstemp's 0600
        check_output(target, kind, inputs, force)
        _swap_in(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def check_distinct(*paths: Path | None) -> None:
    """One command's outputs must be different paths."""
    given = [p for p in paths if p is not None]
    if len(set(given)) != len(given):
        raise OutputError("two outputs name the same path; give each its own")


# --- the rule's parts ------------------------------------------------------------------------------


def _absolute(path: str | Path) -> Path:
    """`path` made absolute with its folders resolved (symlinks, `..`), the last part kept as given
    so that a link there is seen; a path ending in `.` or `..` is resolved whole."""
    raw = Path(path).expanduser()
    if raw.name in ("", ".", ".."):
        return raw.resolve()
    return raw.parent.resolve() / raw.name


def _check_not_input(target: Path, shown: str, raw: str | Path | None) -> None:
    if raw is None or not os.path.lexists(Path(raw).expanduser()):
        return
    source = Path(raw).expanduser().resolve()
    if target == source or target.is_relative_to(source) or source.is_relative_to(target):
        relation = "is" if target == source else "is inside" if target.is_relative_to(source) else "holds"
        raise OutputError(
            f"refusing to write {shown}: it {relation} {raw}, which this command reads; give another path"
        )


def _check_parent(target: Path, shown: str) -> None:
    """The nearest existing folder above `target` must be a folder we may write into."""
    above = target.parent
    while not os.path.lexists(above) and above.parent != above:
        above = above.parent
    if not above.is_dir():
        raise OutputError(f"cannot write {shown}: {above} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {shown}: no permission to write into {above}")


def _swap_in(new: Path, target: Path) -> None:
    """Rename `new` to `target`; an existing `target` is moved aside first and removed only after."""
    if not os.path.lexists(target):
        os.rename(new, target)
        return
    if not target.is_dir():
        os.replace(new, target)  # one atomic rename over the old file
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.specgraph-old-", dir=target.parent))
    os.rename(target, aside / "old")
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(aside / "old", target)  # the swap failed half way: put the old one back
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)


# --- what specgraph made: None if `path` is ours, else why not -------------------------------------


def _bundle(path: Path) -> str | None:
    manifest = _json(path / "manifest.json")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format_version"), int):
        return "no manifest.json with a format_version"
    listed = manifest.get("files")
    listed = set(listed) if isinstance(listed, dict) else set()
    present: list[str] = []
    for folder, dirs, files in os.walk(path):
        names = files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]
        present += [os.path.relpath(os.path.join(folder, n), path) for n in names]
        if len(present) > _MAX_ENTRIES:
            return f"more than {_MAX_ENTRIES} files, far more than a bundle"
    extra = sorted(set(present) - listed - {"manifest.json"})
    if extra:
        return f"files its manifest does not list: {', '.join(extra[:3])}"
    return None


def _heads(path: Path) -> str | None:
    from specgraph.methods.eagle.drafter import FORMAT as EAGLE
    from specgraph.methods.early_exit.adapter import FORMAT as EARLY_EXIT
    from specgraph.methods.medusa.heads import FORMAT as MEDUSA

    if _safetensors_format(path) not in (MEDUSA, EAGLE, EARLY_EXIT):
        return "not a Medusa heads, EAGLE drafter or early-exit adapter file written by specgraph"
    return None


def _feature_cache(path: Path) -> str | None:
    from specgraph.methods.teacher import FEATURES

    if _safetensors_format(path) != FEATURES:
        return "not a feature cache written by specgraph train"
    return None


def _safetensors_format(path: Path) -> Any:
    """The `format` in a safetensors file's metadata (None if it has none or is not one)."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size)) if size <= _MAX_READ else None
    except (OSError, struct.error, ValueError, RecursionError):
        header = None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta.get("format") if isinstance(meta, dict) else None


def _bench_json(path: Path) -> str | None:
    data = _json(path)
    sets = data.get("sets") if isinstance(data, dict) else None
    if isinstance(data, dict) and ({"aggregate", "per_prompt"} <= data.keys() or isinstance(sets, dict)):
        return None
    return "not a report written by specgraph bench"


def _advice_json(path: Path) -> str | None:
    data = _json(path)
    if isinstance(data, dict) and "advice" in data and "sets" in data:
        return None
    return "not a report written by specgraph advise"


def _plot(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            head = f.read(1 << 16)
    except OSError:
        head = b""
    if head.startswith(_PNG) and any(b"tEXtSoftware\x00" + mark.encode() in head for mark in _PLOT_MARKS):
        return None
    return "not a plot written by specgraph bench or advise"


def _gen_cache(path: Path) -> str | None:
    data = _json(path)
    if isinstance(data, dict) and {"key", "sequences"} <= data.keys():
        return None
    return "not a generation cache written by specgraph train"


def _json(path: Path) -> Any:
    """The JSON in `path`, or None if it is missing, too large or not JSON."""
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > _MAX_READ:
            return None
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None


_NOT_OURS: dict[str, Callable[[Path], str | None]] = {
    BUNDLE: _bundle,
    HEADS: _heads,
    BENCH_JSON: _bench_json,
    ADVICE_JSON: _advice_json,
    PLOT: _plot,
    GEN_CACHE: _gen_cache,
    FEATURE_CACHE: _feature_cache,
}


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()  # new files and folders get the usual permissions, not mkstemp's private ones
