"""What an encoder artifact is, found once per engine from its outputs and the files beside it
(docs/design.md, "Contracts"): the text APIs route by it, and it reads config.json and
modules.json, which a request should not read again. No HTTP here.

  sparse            a masked LM with sentence-transformers' SpladePooling (serving/sparse.py)
  masked_lm         another masked LM (serving/fill_mask.py)
  token_classifier  logits per token (serving/token_classify.py)
  classifier        logits of (batch, labels > 1) (serving/classify.py)
  reranker          logits of (batch, 1) (serving/rerank.py)
  embedding         anything else: token or sentence embeddings (serving/embedding.py)"""

from __future__ import annotations

from functools import lru_cache

from serving.classify import logits_width
from serving.fill_mask import is_masked_lm
from serving.sparse import is_sparse
from serving.token_classify import is_token_classifier


@lru_cache(maxsize=8)
def encoder_kind(engine) -> str:
    if is_sparse(engine):
        return "sparse"
    if is_masked_lm(engine):
        return "masked_lm"
    if is_token_classifier(engine):
        return "token_classifier"
    width = logits_width(engine)
    if width is not None:
        return "classifier" if width > 1 else "reranker"
    return "embedding"
