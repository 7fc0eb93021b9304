"""`inspect`: a transformer's dimensions, and where each one lives, from graph structure alone.

    model --linears--> FFN blocks (up/gate -> act -> down)
          --Softmax--> attention blocks (q/k/v/o, head reshapes, scale, rotary)
          --Gather from an input / last GEMM to the output--> embedding, LM head (tied?)
          --com.microsoft ops--> ORT-fused graphs (Attention, SkipLayerNorm, FastGelu)

Names are only ever *reported* (so a rewrite can find the nodes again in its own copy of
the graph); nothing here decides by a name.
"""

from __future__ import annotations

import os
from collections import Counter

import onnx_ir as ir

from tuner.errors import BadInput
from tuner.graph import attention as attn_mod
from tuner.graph import ort_fused
from tuner.graph.dims import Dims
from tuner.graph.encoder_side import (EncoderSide, cross_attention_count, find_encoder_side,
                                      reads_encoder)
from tuner.graph.experts import find_experts
from tuner.graph.ffn import FfnMatch, find_ffns
from tuner.graph.kv_cache import KvCache, find_kv_cache, with_dims
from tuner.graph.lm_head import (Embedding, is_masked_lm_head, is_tied, keep_input, lm_head,
                                 token_embedding, token_ids)
from tuner.graph.load import load_model, name_nodes
from tuner.graph.positions import positions_input, slot_positions
from tuner.graph.rotary_caches import batch_one_rotaries
from tuner.graph.shape import ExpertsSite, FfnSite, LayerSites, ModelShape, Sites
from tuner.graph.walk import Linear, linears


def _ffn_site(m: FfnMatch) -> FfnSite:
    return FfnSite(up=m.up.node.name, down=m.down.node.name,
                   gate=m.gate.node.name if m.gate else None, activation=m.activation,
                   fused_gate_up=m.fused_gate_up)


def _hidden(emb: Embedding | None, ffns: list[FfnMatch], lins: list[Linear]) -> int:
    """The residual stream's width: what the FFN writes back. Not the embedding's width first:
    OPT-350m embeds at 512 and projects in to h=1024 (and back out before the LM head)."""
    if ffns:
        return Counter(f.down.out_dim for f in ffns).most_common(1)[0][0]
    if emb is not None:
        return emb.hidden
    if lins:
        return Counter(lin.in_dim for lin in lins).most_common(1)[0][0]
    return 0


def _slot_positions(graph: ir.Graph, cache: KvCache | None) -> str | None:
    """The rotary positions counted from the cache's length, unless fed (the rewrite's)."""
    if cache is None or positions_input(graph) is not None:
        return None
    found = slot_positions(graph, cache.pasts)
    return found[0].name if found else None


def _layer_ffns(graph: ir.Graph, attns: list[attn_mod.AttnMatch], ffns: list[FfnMatch]
                ) -> tuple[list[FfnMatch | None], list[ExpertsSite]]:
    """Each attention layer's FFN (None where several follow one attention: its experts,
    each an FFN of its own, reported as one ExpertsSite and not padded)."""
    order = {id(node): i for i, node in enumerate(graph)}
    groups: list[list[FfnMatch]] = [[] for _ in attns]
    for f in ffns:
        at = order[id(f.down.node)]
        layer = max((i for i, a in enumerate(attns) if a.order < at), default=0)
        groups[layer].append(f)
    experts = [ExpertsSite(g[0].up.node.name or "", g[0].down.node.name or "", len(g),
                           _one([f.width for f in g])) for g in groups if len(g) > 1]
    return [g[0] if len(g) == 1 else None for g in groups], experts


def _crossing(attns: list[attn_mod.AttnMatch], side: EncoderSide | None
              ) -> tuple[list[attn_mod.AttnMatch], list[attn_mod.AttnMatch]]:
    """(self-attention blocks, cross-attention blocks): an encoder-decoder's decoder attends to
    the encoder's output in each layer too; its layers are its self-attentions."""
    if side is None or side.states is None:
        return attns, []
    cross = [a for a in attns if any(reads_encoder(n, side) for n in a.projection_nodes)]
    return [a for a in attns if a not in cross], cross


def _one(values: list[int]) -> int:
    """The model's value of a per-layer dim (the most common one if layers differ)."""
    if not values:
        return 0
    return Counter(values).most_common(1)[0][0]


def inspect_model(model: ir.Model) -> ModelShape:
    """Dimensions and sites of a loaded model (see tuner.graph.load.load_model): structure
    only; the hardware rules a shape breaks are tuner.plan.findings.audited's. Nodes without a
    unique name are named first (in place), as load_model does.

    Raises BadInput when the graph is not a transformer (no attention block found)."""
    name_nodes(model)  # idempotent; Sites need unique node names even for models not from load_model
    graph = model.graph
    lins = linears(graph)
    ffns = find_ffns(lins)
    emb = token_embedding(graph)
    fusion = ort_fused.scan(graph)
    emb_weight = emb.weight if emb is not None else fusion.embedding
    dims = Dims(model)
    attns = attn_mod.find_attention(graph, lins, dims) + ort_fused.attention_blocks(graph, lins, dims)
    attns.sort(key=lambda a: a.order)
    cache = find_kv_cache(graph)
    side = find_encoder_side(graph, token_ids(emb), cache.pasts if cache is not None else ())
    attns, cross = _crossing(attns, side)
    if not attns:
        what = f"{len(ffns)} feed-forward blocks but " if ffns else ""
        raise BadInput(f"no transformer found in the graph: {what}no attention (a Softmax between "
                       "two activation MatMuls, or a fused Attention op)")
    taken = {id(lin.node) for f in ffns for lin in (f.up, f.down, f.gate) if lin is not None}
    taken |= {id(n) for a in attns + cross for n in a.projection_nodes}
    hidden = _hidden(emb, ffns, lins) or fusion.hidden or 0
    head = lm_head(lins, taken, emb, hidden or None)
    if head is None and emb is not None and emb.hidden != hidden:
        head = lm_head(lins, taken, emb, emb.hidden)  # after a project-out to the embedding width
    tied = head is not None and emb is not None and is_tied(head, emb)
    masked = head is not None and cache is None and is_masked_lm_head(head, lins, taken)
    per_layer: list[FfnMatch | None] = list(ffns)
    experts: list[ExpertsSite] = []
    if len(ffns) > len(attns):  # several FFNs after one attention: experts (Qwen3-MoE)
        per_layer, experts = _layer_ffns(graph, attns, ffns)
    num_layers = max(len(attns), len(per_layer))
    layers = tuple(
        LayerSites(attention=attns[i].site if i < len(attns) else None,
                   ffn=_ffn_site(f) if i < len(per_layer) and (f := per_layer[i]) else None)
        for i in range(num_layers))
    dense = [f for f in per_layer if f is not None]  # the FFNs a rewrite may widen
    heads = _one([a.num_heads for a in attns if a.num_heads])
    kv = _one([a.num_kv_heads for a in attns if a.num_kv_heads]) or heads
    head_dim = _one([a.head_dim for a in attns if a.head_dim])
    if not head_dim and heads and hidden:
        head_dim = hidden // heads
    activation = (dense or ffns)[0].activation if ffns else fusion.activation
    return ModelShape(
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        ffn_size=_one([f.width for f in dense]) or fusion.ffn_size,
        ffn_gated=any(f.gate is not None for f in dense),
        vocab_size=head.out_dim if head is not None else None,
        activation=activation,
        kind="decoder" if head is not None and not masked else "encoder",
        optimized=any(k.startswith(f"{ort_fused.MS}.") and k not in ort_fused.QUANTIZED
                      for k in fusion.fused_ops),
        fused_ops=fusion.fused_ops,
        lengths_mask=fusion.lengths_mask,
        one_row_rotary=tuple(n.name for n in batch_one_rotaries(model, dims)),
        sites=Sites(
            layers=layers,
            lm_head=head.node.name if head is not None else None,
            lm_head_weight=head.weight.name if head is not None else None,
            embedding=emb_weight.name if emb_weight is not None else None,
            tied=tied,
            logits_to_keep=keep_input(graph),
            slot_positions=_slot_positions(graph, cache),
            experts=tuple(experts) or tuple(find_experts(graph)),
        ),
        cache=with_dims(cache, kv, head_dim) if cache is not None else None,
        cross_attention=cross_attention_count(len(cross), side),
        encoder_input=side.states if side is not None else None,
    )


def inspect_path(path: str | os.PathLike) -> ModelShape:
    """load_model + inspect_model."""
    return inspect_model(load_model(path))
