"""Load an untrusted ONNX file into onnx_ir, checking it before anything reads weights.

ONNX files come from users: the protobuf may be truncated or not ONNX at all, and
external-data entries name files by path, so a crafted model could make us read (or, when we
save a variant, write beside) any file on the machine. Every external-data location must be a
relative path that stays inside the model's folder and points at a file that holds the bytes
it claims. Weights stay on disk (onnx_ir maps them lazily), so models over 2 GB load in
little memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError
from onnx_ir.passes.common.inliner import InlinePass
from onnx_ir.passes.common.naming import NameFixPass, SimpleNameGenerator

from tuner.errors import BadInput
from tuner.graph.merged import FLAG, layers_inside, merged_if
from tuner.graph.unfolded import fold_unfolded

T = TypeVar("T")


def _external_entries(proto: onnx.ModelProto):
    """Every TensorProto stored as external data, in the graph, its subgraphs and functions."""
    def tensors_of_graph(g: onnx.GraphProto):
        yield from g.initializer
        for node in g.node:
            yield from _tensors_of_node(node)

    def _tensors_of_node(node: onnx.NodeProto):
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from tensors_of_graph(attr.g)
            for sub in attr.graphs:
                yield from tensors_of_graph(sub)

    yield from (t for t in tensors_of_graph(proto.graph)
                if t.data_location == onnx.TensorProto.EXTERNAL)
    for fn in proto.functions:
        for node in fn.node:
            yield from (t for t in _tensors_of_node(node)
                        if t.data_location == onnx.TensorProto.EXTERNAL)


def external_locations(proto: onnx.ModelProto) -> list[str]:
    """The external-data files a model names (relative locations, sorted, each once)."""
    return sorted({e.value for t in _external_entries(proto) for e in t.external_data
                   if e.key == "location"})


def check_external_data(proto: onnx.ModelProto, model_dir: Path) -> None:
    """Refuse external-data entries that escape `model_dir`, are missing or are too short."""
    root = model_dir.resolve()
    sizes: dict[Path, int] = {}
    for tensor in _external_entries(proto):
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        name = tensor.name or "<unnamed>"
        if not location:
            raise BadInput(f"initializer {name!r} is external but names no location")
        if "\x00" in location:
            raise BadInput(f"initializer {name!r}: external data location {location!r} holds a "
                           "NUL byte; no file can have that name")
        if os.path.isabs(location) or location.startswith(("\\", "/")):
            raise BadInput(f"initializer {name!r}: external data location {location!r} is an "
                           "absolute path; only paths inside the model's folder are allowed")
        target = (root / location).resolve()
        if not target.is_relative_to(root):
            raise BadInput(f"initializer {name!r}: external data location {location!r} points "
                           f"outside the model's folder {root}")
        if target not in sizes:
            if not target.is_file():
                raise BadInput(f"initializer {name!r}: external data file {location!r} is missing "
                               f"(looked in {root})")
            sizes[target] = target.stat().st_size
        try:
            offset = int(info.get("offset", 0))
            length = int(info["length"]) if "length" in info else None
        except ValueError:
            raise BadInput(f"initializer {name!r}: external data offset/length are not integers") from None
        if offset < 0 or (length is not None and length < 0):
            raise BadInput(f"initializer {name!r}: negative external data offset or length")
        if offset + (length or 0) > sizes[target]:
            raise BadInput(f"initializer {name!r}: external data file {location!r} is shorter "
                           f"({sizes[target]} bytes) than the entry claims ({offset}+{length})")


def graphs_folder(folder: Path) -> Path:
    """Where an export folder's graphs lie: in it (Optimum's layout), or, where it holds
    none, in its onnx/ (transformers.js repositories: configs and tokenizer at the top, the
    graphs and their quantized copies below)."""
    below = folder / "onnx"
    if not any(folder.glob("*.onnx")) and below.is_dir() and any(below.glob("*.onnx")):
        return below
    return folder


def folder_hint(p: Path) -> str:
    """What to do with an export folder where one graph was expected ("" for anything else)."""
    graphs = sorted(f.name for f in graphs_folder(p).glob("*.onnx")) if p.is_dir() else []
    if not graphs:
        return ""
    return (f"a folder of graphs ({', '.join(graphs)}), not one: give one of them (`tuner "
            "inspect`, `pad` and `verify` take the whole folder)")


def folder_graphs(folder: Path, read: Callable[[ir.Model], T] = lambda model: None
                  ) -> tuple[dict[Path, T], list[Path]]:
    """An export folder's graphs (sorted by name; graphs_folder: in it or its onnx/), each
    loaded once and given to `read`
    (one in memory at a time), and apart from them the ones whose layers sit inside control
    flow (Optimum's merged decoder: its branches are the plain decoders beside it).
    `tuner inspect`, `pad` and `verify` on a folder."""
    plain, merged = {}, []
    for path in sorted(graphs_folder(folder).glob("*.onnx")):
        model = load_model(path, merged_ok=True)
        if layers_inside(model) is None:
            plain[path] = read(model)
        else:
            merged.append(path)
        del model
    return plain, merged


def read_proto(path: str | os.PathLike) -> onnx.ModelProto:
    """The ModelProto without external data, or BadInput with one clear line."""
    p = Path(path)
    if not p.exists():
        raise BadInput(f"{p}: no such file")
    if not p.is_file():
        raise BadInput(f"{p}: {folder_hint(p) or 'not a file'}")
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except (DecodeError, onnx.onnx_cpp2py_export.checker.ValidationError, ValueError,
            RuntimeError, UnicodeDecodeError) as e:
        raise BadInput(f"{p}: not a readable ONNX model ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else 'corrupt or truncated protobuf'})") from None
    if not proto.HasField("graph") or not proto.graph.node:
        raise BadInput(f"{p}: not an ONNX model (no graph with nodes; truncated or another file type?)")
    if not proto.opset_import:
        raise BadInput(f"{p}: not an ONNX model (no opset import)")
    _check_single_writers(proto.graph, p)
    return proto


def _check_single_writers(graph: onnx.GraphProto, p: Path) -> None:
    """Every value of the main graph has one producer (SSA): a node output that is also a
    graph input, an initializer or another node's output makes an invalid graph."""
    written = {v.name: "a graph input" for v in graph.input}
    written.update({t.name: "an initializer" for t in graph.initializer})
    written.update({t.values.name: "an initializer" for t in graph.sparse_initializer})
    for node in graph.node:
        for out in node.output:
            if not out:
                continue
            if out in written:
                raise BadInput(f"{p}: not a valid ONNX graph: value {out!r} is written twice "
                               f"({written[out]} and {node.op_type} node {node.name!r})")
            written[out] = f"{node.op_type} node {node.name!r}"
    for node in graph.node:
        for name in node.input:
            if name and name not in written:
                raise BadInput(f"{p}: not a valid ONNX graph: input {name!r} of {node.op_type} "
                               f"node {node.name!r} is produced by nothing (no graph input, "
                               "initializer or node writes it)")


@contextlib.contextmanager
def _quiet_onnx_ir():
    """onnx_ir logs a warning line for each oddity it tolerates; the checks above refuse the
    ones that matter with one line of our own, so its lines stay off stderr."""
    logger = logging.getLogger("onnx_ir")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_model(path: str | os.PathLike, merged_ok: bool = False) -> ir.Model:
    """The checked model as onnx_ir, with external data resolved lazily beside the file,
    model-local functions inlined and every node uniquely named. A model whose layers lie
    inside control flow is BadInput, unless `merged_ok` (`tuner unmerge` reads one)."""
    p = Path(path)
    proto = read_proto(p)
    check_external_data(proto, p.parent)
    try:
        with _quiet_onnx_ir():
            model = ir.serde.deserialize_model(proto)
    except Exception as e:  # noqa: BLE001 - onnx_ir refuses a graph it cannot represent
        cause = e.__cause__ or e
        raise BadInput(f"{p}: not a valid ONNX graph ({type(cause).__name__}: "
                       f"{str(cause).splitlines()[0] if str(cause) else 'unreadable'})") from None
    ir.external_data.set_base_dir(model.graph, str(p.parent.resolve()))
    if not merged_ok:
        _refuse_model_inside_control_flow(model, p)
    if not _in_order(model.graph):
        # ONNX Runtime runs a graph whose nodes are out of order, and such files are shipped:
        # onnxruntime.transformers.float16 with keep_io_types (transformers.js' q4f16 copies)
        # appends its input Casts after the nodes that read them. onnx_ir's clone and every
        # walk here read nodes in order: sorted once, stably, as it loads.
        model.graph.sort()
    if model.functions:
        # Model-local functions hide their bodies from structural detection (STYLE.md):
        # inline them here, so that inspect and every rewrite see the same flat graph.
        InlinePass()(model)
    fold_unfolded(model)  # torch's unoptimized export read as its optimized one
    name_nodes(model)
    return model


def _in_order(graph: ir.Graph) -> bool:
    """Whether every node comes after the nodes whose outputs it reads."""
    seen: set[ir.Node] = set()
    for node in graph:
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and producer.graph is graph and producer not in seen:
                return False
        seen.add(node)
    return True


def _refuse_model_inside_control_flow(model: ir.Model, p: Path) -> None:
    """A model whose layers lie inside an If (Optimum's legacy merged decoder,
    tuner.graph.merged) has no transformer in the top-level graph that every stage reads:
    refused with what to do, not with "no attention"."""
    node = layers_inside(model)
    if node is None:
        return
    if merged_if(model) is node:
        raise BadInput(f"{p}: an Optimum merged decoder (its layers inside If {node.name!r} on "
                       f"the input {FLAG}): make it one plain graph first, `tuner unmerge "
                       f"{p} -o model.onnx` (verified against this file), or export with "
                       "`optimum-cli export onnx --task text-generation-with-past`; an "
                       "encoder-decoder's (T5, BART, Whisper) has its two branches beside it, "
                       "decoder_model.onnx and decoder_with_past_model.onnx")
    raise BadInput(f"{p}: the model's layers lie inside {node.op_type} {node.name!r}; "
                   "shapetuner reads them from the top-level graph: export without control "
                   "flow around the layers")


class _Names(SimpleNameGenerator):
    """Empty node names become the op type; NameFixPass then makes every name unique."""

    def generate_node_name(self, node: ir.Node) -> str:
        return node.name or node.op_type


def name_nodes(model: ir.Model) -> None:
    """Give every node (and value) a unique name: Sites refer to nodes by name, and some
    exporters leave names empty or repeat them. Names already unique are kept, so the same
    file always loads with the same names."""
    NameFixPass(_Names())(model)


# Models past this many bytes of weights are saved with external data (protobuf's 2 GB cap).
EXTERNAL_DATA_BYTES = 1_500_000_000


def save_graph(model: ir.Model, dst: str | os.PathLike) -> Path:
    """Write `model` to `dst` in the folder it was read from, keeping its weights where they
    lie: weights read from external data stay references to the same files beside `dst`
    (nothing is copied: a graph edited beside a big model's own writes kilobytes), the rest
    goes in the file. Atomic like `save_model`."""
    dst = Path(dst)
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=f".{dst.name}.") as tmp:
        tmp_path = Path(tmp) / dst.name
        ir.save(model, tmp_path)
        os.replace(tmp_path, dst)
    return dst


def save_model(model: ir.Model, dst: str | os.PathLike) -> Path:
    """Write `model` to `dst` so that `dst` is either the old file or the complete new one.

    Writes into a temporary folder beside `dst`, then renames (atomic on one file system);
    a failure or Ctrl-C leaves no half-written file. Large models (and models read with
    external data) get their weights in `dst.name + ".data"` beside it (renamed first, so the
    .onnx never points at nothing)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tensors = [v.const_value for v in model.graph.initializers.values() if v.const_value is not None]
    # Weights still mapped from the source's external data must be copied into our own data
    # file: a plain save would keep pointing at the source's file, relative to the new folder.
    big = (sum(t.nbytes for t in tensors) > EXTERNAL_DATA_BYTES
           or any(isinstance(t, ir.ExternalTensor) for t in tensors))
    data_name = dst.name + ".data"
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=f".{dst.name}.") as tmp:
        tmp_path = Path(tmp) / dst.name
        if big:
            ir.save(model, tmp_path, external_data=data_name)
            os.replace(Path(tmp) / data_name, dst.parent / data_name)
        else:
            ir.save(model, tmp_path)
        os.replace(tmp_path, dst)
    return dst
