"""Regenerate serving/wire/_generated/ from protos/inference.proto: `python -m serving.wire.gen_protos`.

One command, run after any edit of the .proto; tests/test_serving_protos.py fails when the
committed stubs differ from what this writes.

The committed stubs were generated with grpcio-tools 1.72.2, whose protobuf gencode (6.30)
loads on protobuf 6.30+ and 7.x runtimes (tritonclient requires protobuf < 7; a newer
generator would write stubs that refuse protobuf 6). Regenerate with that version, e.g.
    python3 -m venv /tmp/gt && /tmp/gt/bin/pip install grpcio-tools==1.72.2
    /tmp/gt/bin/python -m serving.wire.gen_protos
The staleness test compares the generated descriptor and RPC paths, not the generator's
text, so it holds with any grpcio-tools version installed.

Two things differ from a plain `grpc_tools.protoc` run, both on purpose:
- the .proto is compiled as `serving/wire/_generated/inference.proto`, so the generated modules
  import each other as `serving.wire._generated...` instead of as top-level modules;
- the descriptors go into a private pool (serving.wire._generated.POOL), not protobuf's default
  one: tritonclient registers the same full names (`inference.ModelInferRequest`, from its
  own grpc_service.proto) in the default pool, and a process that imports both (a test, a
  benchmark, a user's script) would otherwise fail with "duplicate symbol".
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "protos" / "inference.proto"
OUT_DIR = ROOT / "serving" / "wire" / "_generated"
PACKAGE_PATH = "serving/wire/_generated"
GENERATED = ("inference_pb2.py", "inference_pb2_grpc.py")
_DEFAULT_POOL = "_descriptor_pool.Default().AddSerializedFile("
_PRIVATE_POOL = "_POOL.AddSerializedFile("
_POOL_IMPORT = "from serving.wire._generated import POOL as _POOL\n"


def _private_pool(source: str) -> str:
    if source.count(_DEFAULT_POOL) != 1:
        raise RuntimeError("generated inference_pb2.py no longer looks as expected: "
                           "cannot move its descriptors into the private pool")
    marker = "# @@protoc_insertion_point(imports)\n"
    source = source.replace(marker, marker + _POOL_IMPORT, 1)
    return source.replace(_DEFAULT_POOL, _PRIVATE_POOL, 1)


def generate(out_dir: Path, proto_text: str | None = None) -> list[Path]:
    """Write the generated modules into `out_dir`; returns their paths. `proto_text`
    replaces the .proto's content (tests use it to show that an edit is noticed)."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "src"), Path(tmp, "out")
        (src / PACKAGE_PATH).mkdir(parents=True)
        dst.mkdir()
        (src / PACKAGE_PATH / PROTO.name).write_text(
            PROTO.read_text() if proto_text is None else proto_text)
        include = Path(protoc.__file__).parent / "_proto"
        rc = protoc.main(["grpc_tools.protoc", f"-I{src}", f"-I{include}",
                          f"--python_out={dst}", f"--grpc_python_out={dst}",
                          str(src / PACKAGE_PATH / PROTO.name)])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            text = (dst / PACKAGE_PATH / name).read_text()
            if name == "inference_pb2.py":
                text = _private_pool(text)
            (out_dir / name).write_text(text)
            written.append(out_dir / name)
        return written


GENERATOR = "1.72.2"


def main() -> int:
    from importlib.metadata import version

    found = version("grpcio-tools")
    if found != GENERATOR:
        print(f"warning: grpcio-tools {found}, not {GENERATOR}: the stubs written now need a "
              f"protobuf runtime at least as new as its gencode (see this module's docstring)",
              file=sys.stderr)
    for path in generate(OUT_DIR):
        print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
