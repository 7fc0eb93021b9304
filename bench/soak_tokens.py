"""bench/soak.py's clients for the encoders whose answers are per token: a SPLADE model (TEI's
/embed_sparse), a token classifier (its entities, as InferenceClient.token_classification
asks for them) and another masked LM (its fills, as InferenceClient.fill_mask asks), on top
of what every encoder gets (bench/soak_encoders.py). Each answer is checked against what the
idle server answered for that input alone: the same entries, entities or fills, every value
within 1e-5."""

from __future__ import annotations

import random

import numpy as np

from serve_common import MODEL_NAME
from soak_encoders import ATOL, TEXTS, EncoderClients
from soak_scores import info

STRATEGIES = ("none", "simple", "first", "average", "max")


class _Answers(EncoderClients):
    """An encoder whose references are JSON answers, not vectors: compared by `same`."""

    @staticmethod
    def same(got, want) -> bool:
        raise NotImplementedError

    def _compare(self, key, got) -> None:
        self.checked += 1
        if not self.same(got, self.refs[key]):
            self.mismatches.append(f"input {key}: {str(got)[:160]} against the idle server's "
                                   f"{str(self.refs[key])[:160]}")

    def unchanged(self) -> bool:
        now = self._references()
        return all(self.same(now[k], self.refs[k]) for k in now)


class SparseClients(_Answers):
    """TEI's /embed_sparse and `POST /` (TEI routes it there for a SPLADE model); the
    reference: each text's entries, alone, from /embed_sparse."""

    checked_what = "sparse vectors"
    bad_bodies = (("/embed_sparse", {"inputs": []}),
                  ("/embed_sparse", {"inputs": 5}),
                  ("/embed_sparse", {"inputs": ["a"], "truncate": "yes please"}),
                  ("/v1/embeddings", {"model": MODEL_NAME, "input": ["a"]}))  # no dense

    def _references(self) -> dict:
        return {k: self._sparse("/embed_sparse", [k])[0] for k in range(len(TEXTS))}

    def _sparse(self, path: str, picked: list[int]) -> list[dict[int, float]]:
        got = self._posted(path, {"inputs": [TEXTS[k] for k in picked], "truncate": True})
        return [{e["index"]: e["value"] for e in row} for row in got]

    @staticmethod
    def same(got: dict[int, float], want: dict[int, float]) -> bool:
        # as dense vectors: an entry at the edge of zero may be left out on one side
        keys = sorted(set(got) | set(want))
        return np.allclose([got.get(i, 0.0) for i in keys], [want.get(i, 0.0) for i in keys],
                           atol=ATOL)

    def _heavy(self, r: random.Random) -> tuple[str, dict]:
        return "/embed_sparse", {"inputs": [TEXTS[-1]] * r.randint(1, 8), "truncate": True}

    def tei(self, r: random.Random) -> str:
        picked = r.choices(range(len(TEXTS)), k=r.randint(1, 8))
        path = r.choice(("/embed_sparse", "/"))
        for k, got in zip(picked, self._sparse(path, picked), strict=True):
            self._compare(k, got)
        return f"TEI {path} (sparse), checked (http)"

    def actions(self):
        return (self.tei, self.tei, self.tei, *super().actions())


class TaggerClients(_Answers):
    """Hugging Face's Inference API for a token classifier on `POST /` (one text, under each
    aggregation strategy), half of them through InferenceClient.token_classification; the
    reference: each (text, strategy)'s entities, alone."""

    checked_what = "entity lists"
    bad_bodies = (("/", {"inputs": ""}),
                  ("/", {"inputs": "a", "parameters": {"aggregation_strategy": "most"}}),
                  ("/", {"inputs": "a", "parameters": {"ignore_labels": "O"}}),
                  ("/", {"inputs": ["a", "b"]}))

    def __init__(self, grpc_port: int, http_port: int) -> None:
        super().__init__(grpc_port, http_port)
        self.hub = _inference_client(http_port)

    def _references(self) -> dict:
        return {(k, s): self._tagged(k, s) for k in range(len(TEXTS)) for s in STRATEGIES}

    def _tagged(self, k: int, strategy: str) -> list[dict]:
        return self._posted("/", {"inputs": TEXTS[k],
                                  "parameters": {"aggregation_strategy": strategy}})

    @staticmethod
    def same(got: list[dict], want: list[dict]) -> bool:
        def fields(entities):
            return [(e.get("entity_group") or e.get("entity"), e["word"], e["start"], e["end"])
                    for e in entities]

        return fields(got) == fields(want) and np.allclose(
            [e["score"] for e in got], [e["score"] for e in want], atol=ATOL)

    def _heavy(self, r: random.Random) -> tuple[str, dict]:
        return "/", {"inputs": TEXTS[-1], "parameters": {"aggregation_strategy": "simple"}}

    def inference_api(self, r: random.Random) -> str:
        k, strategy = r.randrange(len(TEXTS)), r.choice(STRATEGIES)
        self._compare((k, strategy), self._tagged(k, strategy))
        return "POST / (token classification), checked (http)"

    def hub_client(self, r: random.Random) -> str:
        k, strategy = r.randrange(len(TEXTS)), r.choice(STRATEGIES)
        got = self.hub.token_classification(TEXTS[k], aggregation_strategy=strategy)
        self._compare((k, strategy), [{"entity_group": e.entity_group, "entity": e.entity,
                                       "word": e.word, "start": e.start, "end": e.end,
                                       "score": e.score} for e in got])
        return "token_classification, checked (huggingface_hub)"

    def actions(self):
        return (self.inference_api, self.hub_client, *super().actions())


class FillMaskClients(_Answers):
    """Hugging Face's Inference API for a masked LM on `POST /` (a text with one mask, the
    top k fills), half through InferenceClient.fill_mask; the reference: each text's top 5,
    alone (a request for fewer gets their first k)."""

    checked_what = "fill lists"
    bad_bodies = (("/", {"inputs": "no mask here"}),
                  ("/", {"inputs": "a [MASK]", "parameters": {"top_k": 0}}),
                  ("/", {"inputs": "a [MASK]", "parameters": {"targets": []}}))

    def __init__(self, grpc_port: int, http_port: int) -> None:
        super().__init__(grpc_port, http_port)
        self.hub = _inference_client(http_port)
        mask = info(http_port)["model_type"]["masked_lm"]["mask_token"]
        # a mask in each text, at a place of its own (the longest past the model's length)
        self.masked = [" ".join(_masked(t.split(), k, mask)) for k, t in enumerate(TEXTS)]

    def _references(self) -> dict:
        return {k: self._filled(k, 5) for k in range(len(TEXTS))}

    def _filled(self, k: int, top: int) -> list[dict]:
        return self._posted("/", {"inputs": self.masked[k], "parameters": {"top_k": top}})

    @staticmethod
    def same(got: list[dict], want: list[dict]) -> bool:
        """`got`: the first k of the top 5 `want` holds."""
        if not 0 < len(got) <= len(want):
            return False
        want = want[:len(got)]
        return ([(f["token"], f["token_str"], f["sequence"]) for f in got]
                == [(f["token"], f["token_str"], f["sequence"]) for f in want]
                and np.allclose([f["score"] for f in got], [f["score"] for f in want],
                                atol=ATOL))

    def _heavy(self, r: random.Random) -> tuple[str, dict]:
        return "/", {"inputs": self.masked[-1], "parameters": {"top_k": 5}}

    def _compare_top(self, k: int, top: int, got: list[dict]) -> None:
        if len(got) != top:
            raise RuntimeError(f"{len(got)} fills for top_k {top}")
        self._compare(k, got)

    def inference_api(self, r: random.Random) -> str:
        k, top = r.randrange(len(TEXTS)), r.randint(1, 5)
        self._compare_top(k, top, self._filled(k, top))
        return "POST / (fill-mask), checked (http)"

    def hub_client(self, r: random.Random) -> str:
        k, top = r.randrange(len(TEXTS)), r.randint(1, 5)
        got = self.hub.fill_mask(self.masked[k], top_k=top)
        self._compare_top(k, top, [{"token": f.token, "token_str": f.token_str,
                                    "sequence": f.sequence, "score": f.score} for f in got])
        return "fill_mask, checked (huggingface_hub)"

    def actions(self):
        return (self.inference_api, self.hub_client, *super().actions())


def _masked(words: list[str], k: int, mask: str) -> list[str]:
    at = min(len(words), 3 + k)  # within the model's length for every text
    return [*words[:at], mask, *words[at:]]


def _inference_client(http_port: int):
    """huggingface_hub's InferenceClient on the server, online: the suite's offline mode
    (HF_HUB_OFFLINE) also stops it reaching a local server, which a user's client reaches."""
    from huggingface_hub import InferenceClient, constants

    constants.HF_HUB_OFFLINE = False
    return InferenceClient(model=f"http://127.0.0.1:{http_port}", timeout=120)
