"""The artifact folder on disk: OUT/manifest.json written atomically, read back validated, and
every variant path checked to stay inside OUT."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tuner.artifact.codec import manifest_from_json, manifest_to_json
from tuner.artifact.records import Manifest, Variant
from tuner.errors import BadInput
from tuner.util.files import atomic_write

MANIFEST = "manifest.json"


def write_manifest(out_dir: str | os.PathLike, manifest: Manifest) -> Path:
    """Write OUT/manifest.json atomically (temp file in OUT, fsync, rename)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(manifest_to_json(manifest), indent=2, allow_nan=False) + "\n"
    return atomic_write(out / MANIFEST, text, fsync=True)


def read_manifest(out_dir: str | os.PathLike, check_files: bool = True) -> Manifest:
    """Read and validate OUT/manifest.json. With `check_files`, every variant's graph must
    exist inside OUT (symlinks resolved). BadInput with one clear line on any problem."""
    out = Path(out_dir)
    path = out / MANIFEST
    if not out.is_dir():
        raise BadInput(f"{out}: not an artifact folder (no such directory)")
    if not path.is_file():
        raise BadInput(f"{out}: not an artifact folder (no {MANIFEST}; run `tuner optimize` first)")
    if path.stat().st_size > 64 * 1024 * 1024:
        raise BadInput(f"{path}: too large for a manifest")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise BadInput(f"{path}: not a manifest (JSON nested too deeply to read)") from None
    try:
        m = manifest_from_json(obj)
    except RecursionError:
        raise BadInput(f"{path}: not a manifest (JSON nested too deeply to read)") from None
    if check_files:
        for v in m.variants:
            variant_path(out, v)
    return m


def variant_path(out_dir: str | os.PathLike, variant: Variant) -> Path:
    """The absolute path of a variant's graph; BadInput if it escapes OUT or is missing."""
    root = Path(out_dir).resolve()
    p = (root / variant.path).resolve()
    if not p.is_relative_to(root):
        raise BadInput(f"manifest: variant {variant.name!r} path {variant.path!r} leaves the "
                       "artifact folder")
    if not p.is_file():
        raise BadInput(f"manifest: variant {variant.name!r} graph {variant.path!r} is missing")
    return p
