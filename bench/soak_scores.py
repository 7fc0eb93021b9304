"""bench/soak.py's clients for a served reranker (a cross-encoder) and a served classifier:
their own APIs, on top of what every encoder gets (bench/soak_encoders.py). Each score is
checked against what the idle server answered for that input alone."""

from __future__ import annotations

import json
import random
import urllib.request

from serve_common import MODEL_NAME
from soak_encoders import TEXTS, EncoderClients

QUERIES = TEXTS[1:4]


class RerankClients(EncoderClients):
    """vLLM's and Jina's /v1/rerank, Cohere's /v2/rerank, TEI's /rerank and vLLM's /score;
    the reference: each (query, document) pair's score, alone, from /score."""

    checked_what = "scores"
    bad_bodies = (("/v1/rerank", {"model": MODEL_NAME, "query": "", "documents": ["a"]}),
                  ("/v1/rerank", {"model": MODEL_NAME, "query": "a", "documents": "a"}),
                  ("/v2/rerank", {"model": MODEL_NAME, "query": "a", "documents": ["a"],
                                  "top_n": -1}),
                  ("/rerank", {"query": "a", "texts": []}),
                  ("/score", {"model": MODEL_NAME, "text_1": 5, "text_2": ["a"]}))

    def _references(self) -> dict:
        return {(q, d): self._scored(q, [d])[0] for q in range(len(QUERIES))
                for d in range(len(TEXTS))}

    def _scored(self, q: int, docs: list[int]) -> list[float]:
        got = self._posted("/score", {"model": MODEL_NAME, "text_1": QUERIES[q],
                                      "text_2": [TEXTS[d] for d in docs]})
        return [row["score"] for row in sorted(got["data"], key=lambda row: row["index"])]

    def _heavy(self, r: random.Random) -> tuple[str, dict]:
        return "/rerank", {"query": QUERIES[0], "texts": [TEXTS[-1]] * r.randint(1, 8)}

    def _asked(self, r: random.Random) -> tuple[int, list[int]]:
        return r.randrange(len(QUERIES)), r.choices(range(len(TEXTS)), k=r.randint(1, 8))

    def _check_ranked(self, q: int, docs: list[int], ranked: list[tuple[int, float]]) -> None:
        """`ranked`: (index into docs, score), best first, as every rerank API answers."""
        if [s for _, s in ranked] != sorted((s for _, s in ranked), reverse=True):
            raise RuntimeError("a rerank answer is not ordered best first")
        self._check([(q, docs[i]) for i, _ in ranked], [s for _, s in ranked], self.refs)

    def rerank(self, r: random.Random) -> str:
        q, docs = self._asked(r)
        path = r.choice(("/v1/rerank", "/v2/rerank"))
        got = self._posted(path, {"model": MODEL_NAME, "query": QUERIES[q],
                                  "documents": [TEXTS[d] for d in docs]})
        self._check_ranked(q, docs, [(x["index"], x["relevance_score"])
                                     for x in got["results"]])
        return f"rerank ({path}), checked (http)"

    def tei(self, r: random.Random) -> str:
        q, docs = self._asked(r)
        got = self._posted("/rerank", {"query": QUERIES[q], "texts": [TEXTS[d] for d in docs],
                                       "truncate": True})
        self._check_ranked(q, docs, [(x["index"], x["score"]) for x in got])
        return "TEI /rerank, checked (http)"

    def score(self, r: random.Random) -> str:
        q, docs = self._asked(r)
        self._check([(q, d) for d in docs], self._scored(q, docs), self.refs)
        return "/score, checked (http)"

    def actions(self):
        return (self.rerank, self.rerank, self.tei, self.score, *super().actions())


class ClassifierClients(EncoderClients):
    """TEI's /predict (a text, and a pair as NLI takes it), vLLM's /classify and KServe V1
    predict (the best label's id); the reference: each text's probabilities, alone, from
    /classify."""

    checked_what = "scores"

    def __init__(self, grpc_port: int, http_port: int) -> None:
        super().__init__(grpc_port, http_port)
        names = info(http_port)["model_type"]["classifier"]["id2label"]
        self.labels = [names[str(i)] for i in range(len(names))]

    bad_bodies = (("/predict", {"inputs": []}),
                  ("/predict", {"inputs": [["a", "b", "c"]]}),
                  ("/classify", {"model": MODEL_NAME, "input": 5}),
                  ("/classify", {"model": MODEL_NAME, "input": ["a"],
                                 "truncate_prompt_tokens": "many"}))

    def _references(self) -> dict:
        refs = {k: self._classified([k])[0] for k in range(len(TEXTS))}
        for k in range(len(QUERIES)):  # pairs, as TEI's /predict takes them
            refs["pair", k] = self._predicted([[QUERIES[k], TEXTS[k]]])[0]
        return refs

    def _classified(self, picked: list[int]) -> list[list[float]]:
        got = self._posted("/classify", {"model": MODEL_NAME,
                                         "input": [TEXTS[k] for k in picked]})
        return [row["probs"] for row in sorted(got["data"], key=lambda row: row["index"])]

    def _predicted(self, inputs: list) -> list[list[float]]:
        """TEI's /predict of a batch: each input's scores, in the label order of /info."""
        got = self._posted("/predict", {"inputs": inputs, "truncate": True})
        return [[{x["label"]: x["score"] for x in row}[name] for name in self.labels]
                for row in got]

    def _heavy(self, r: random.Random) -> tuple[str, dict]:
        return "/predict", {"inputs": [[TEXTS[-1]]] * r.randint(1, 8), "truncate": True}

    def classify(self, r: random.Random) -> str:
        picked = r.choices(range(len(TEXTS)), k=r.randint(1, 8))
        self._check(picked, self._classified(picked), self.refs)
        return "/classify, checked (http)"

    def tei(self, r: random.Random) -> str:
        picked = r.choices(range(len(TEXTS)), k=r.randint(1, 6))
        pairs = r.choices(range(len(QUERIES)), k=r.randint(0, 2))
        got = self._predicted([[TEXTS[k]] for k in picked] +
                              [[QUERIES[k], TEXTS[k]] for k in pairs])
        self._check(picked + [("pair", k) for k in pairs], got, self.refs)
        return "TEI /predict, texts and pairs, checked (http)"

    def kserve_v1(self, r: random.Random) -> str:
        picked = r.choices(range(len(TEXTS)), k=r.randint(1, 4))
        got = self._posted(f"/v1/models/{MODEL_NAME}:predict",
                           {"instances": [TEXTS[k] for k in picked]})["predictions"]
        want = [max(range(len(self.refs[k])), key=self.refs[k].__getitem__) for k in picked]
        self.checked += len(picked)
        if got != want:
            self.mismatches.append(f"KServe V1 labels {got} against the idle server's {want}")
        return "KServe V1 predict, checked (http)"

    def actions(self):
        return (self.classify, self.tei, self.tei, self.kserve_v1, *super().actions())


def info(http_port: int) -> dict:
    """TEI's /info: what kind of encoder is served (its `model_type`), as TEI's clients ask."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/info", timeout=30) as f:
        return json.load(f)
