"""bench/soak.py's clients for a served encoder: an embedding model, a reranker (a
cross-encoder) or a classifier. Every answer is checked against what the idle server answered
for each input alone, so batching, requests side by side, truncation and dropped connections
must leave every vector and score as it is (to 1e-5: rows padded in one run are equal to float
rounding, not bit for bit).

What every encoder gets: tritonclient.grpc and tritonclient.http on the graph's own tensors
(the raw output checked against the idle server's for the same ids; gRPC calls cancelled
midway now and then), requests whose connection closes before the answer, and malformed
bodies and tensors that must be refused (HTTP 4xx, gRPC INVALID_ARGUMENT). Then each kind's
own APIs: an embedding model's OpenAI embeddings (float and base64), TEI's /embed, Ollama's
/api/embed and KServe V1 predict; a reranker's vLLM and Jina's /v1/rerank, Cohere's
/v2/rerank, TEI's /rerank and vLLM's /score; a classifier's TEI /predict (texts and pairs),
vLLM's /classify and KServe V1 predict.
"""

from __future__ import annotations

import base64
import http.client
import json
import random

import numpy as np

from serve_common import MODEL_NAME

WORDS = ("the quick brown fox jumps over a lazy dog while foxes live in forests and dogs sleep "
         "near the river bank").split()
# texts of 1 to ~400 words: the longest past the model's input, cut by the server
TEXTS = [" ".join(random.Random(k).choice(WORDS) for _ in range(1 + k * k * 4))
         for k in range(11)]
# token ids for the raw tensors: within the smallest vocabulary a test model has (106)
ID_ROWS = [random.Random(k).choices(range(5, 100), k=3 + 25 * k) for k in range(6)]
ATOL = 1e-5


class EncoderClients:
    """The clients every encoder gets, and the check; a kind adds its APIs' actions, its
    references (`_references`: key -> the idle server's answer for that input alone) and
    its malformed bodies. Each action takes a seeded Random and returns the row it counts
    under, raising on what a correct server would not do; answers unlike the idle server's
    are recorded in `mismatches`."""

    checked_what = "vectors"
    bad_bodies: tuple = ()  # (path, body) pairs a correct server refuses with 4xx

    def __init__(self, grpc_port: int, http_port: int) -> None:
        self.grpc_port, self.http_port = grpc_port, http_port
        self.inputs, self.output = _signature(grpc_port)
        self.refs: dict = {}
        self.raw_refs: dict = {}
        self.checked = 0
        self.mismatches: list[str] = []

    def record_references(self) -> None:
        self.raw_refs = {k: self._grpc_raw(row) for k, row in enumerate(ID_ROWS)}
        self.refs = self._references()

    def _references(self) -> dict:
        raise NotImplementedError

    def _heavy(self, r: random.Random) -> tuple[str, dict]:
        """A valid request of the longest inputs (for one dropped before its answer)."""
        raise NotImplementedError

    def unchanged(self) -> bool:
        now = self._references()
        return all(np.allclose(now[k], self.refs[k], atol=ATOL) for k in now)

    def _check(self, keys: list, answers, refs: dict) -> None:
        if len(answers) != len(keys):
            raise RuntimeError(f"{len(answers)} answers for {len(keys)} inputs")
        for k, got in zip(keys, answers):
            self.checked += 1
            got, want = np.asarray(got, np.float32), np.asarray(refs[k], np.float32)
            if got.shape != want.shape or not np.allclose(got, want, atol=ATOL):
                what = (f"max abs difference {np.abs(got - want).max():.2g}"
                        if got.shape == want.shape else f"shape {got.shape}")
                self.mismatches.append(f"input {k}: {what} from the idle server's answer")

    def _post(self, path: str, body) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=120)
        try:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            answer = conn.getresponse()
            return answer.status, answer.read()
        finally:
            conn.close()

    def _posted(self, path: str, body: dict):
        status, data = self._post(path, body)
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}: {data[:200]!r}")
        return json.loads(data)

    def _grpc_raw(self, row: list[int], cancel: bool = False):
        import tritonclient.grpc as tg

        client = tg.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
        try:
            inputs = _tensors(tg, self.inputs, row)
            if not cancel:
                return client.infer(MODEL_NAME, inputs).as_numpy(self.output)[0]
            call = client.async_infer(MODEL_NAME, inputs, callback=lambda result, error: None)
            call.cancel()
            return None
        finally:
            client.close()

    def triton_grpc(self, r: random.Random) -> str:
        k = r.randrange(len(ID_ROWS))
        if r.random() < 0.25:
            self._grpc_raw(ID_ROWS[k], cancel=True)
            return "infer cancelled (tritonclient.grpc)"
        self._check([k], [self._grpc_raw(ID_ROWS[k])], self.raw_refs)
        return "infer, checked (tritonclient.grpc)"

    def triton_http(self, r: random.Random) -> str:
        import tritonclient.http as th

        k = r.randrange(len(ID_ROWS))
        client = th.InferenceServerClient(f"127.0.0.1:{self.http_port}")
        try:
            binary = r.random() < 0.5
            inputs = _tensors(th, self.inputs, ID_ROWS[k], binary)
            out = [th.InferRequestedOutput(self.output, binary_data=binary)]
            got = client.infer(MODEL_NAME, inputs, outputs=out).as_numpy(self.output)
        finally:
            client.close()
        self._check([k], [got[0]], self.raw_refs)
        return "infer, checked (tritonclient.http)"

    def dropped(self, r: random.Random) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=60)
        path, body = self._heavy(r)
        conn.request("POST", path, json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        conn.close()  # before the answer
        return "request dropped before its answer (http)"

    def malformed(self, r: random.Random) -> str:
        if r.random() < 0.3 or not self.bad_bodies:
            return self._malformed_tensor(r)
        path, body = r.choice((*self.bad_bodies, ("/", b"{not json")))
        status, data = self._post(path, body)
        if not 400 <= status < 500:
            raise RuntimeError(f"a malformed body to {path} answered HTTP {status}: "
                               f"{data[:120]!r}")
        return "malformed, answered 4xx (http)"

    def _malformed_tensor(self, r: random.Random) -> str:
        import tritonclient.grpc as tg
        from tritonclient.utils import InferenceServerException

        client = tg.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
        wrong = r.choice(("id", "dtype", "shape"))
        row = [10 ** 9] if wrong == "id" else ID_ROWS[0]
        inputs = _tensors(tg, self.inputs, row)
        ids, mask = self.inputs.index("input_ids"), self.inputs.index("attention_mask")
        if wrong == "dtype":
            inputs[ids] = tg.InferInput("input_ids", [1, len(row)], "FP32")
            inputs[ids].set_data_from_numpy(np.array([row], np.float32))
        elif wrong == "shape":
            inputs[mask] = tg.InferInput("attention_mask", [1, 2], "INT64")
            inputs[mask].set_data_from_numpy(np.ones((1, 2), np.int64))
        try:
            client.infer(MODEL_NAME, inputs)
        except InferenceServerException as e:
            if "INVALID_ARGUMENT" not in str(e.status()):
                raise
            return "malformed tensor, INVALID_ARGUMENT (tritonclient.grpc)"
        finally:
            client.close()
        raise RuntimeError(f"a request with a wrong {wrong} was answered")

    def actions(self):
        return (self.triton_grpc, self.triton_http, self.dropped, self.malformed)


class EmbeddingClients(EncoderClients):
    def __init__(self, grpc_port: int, http_port: int) -> None:
        import openai

        super().__init__(grpc_port, http_port)
        self.openai = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1",
                                    api_key="unused", max_retries=0, timeout=120)

    bad_bodies = (("/v1/embeddings", {"model": MODEL_NAME, "input": []}),
                  ("/v1/embeddings", {"model": MODEL_NAME, "input": 5}),
                  ("/v1/embeddings", {"model": MODEL_NAME, "input": [[1, 2, 10 ** 9]]}),
                  ("/v1/embeddings", {"model": MODEL_NAME, "input": ["a"],
                                      "encoding_format": "hex"}),
                  ("/embed", {"inputs": None}),
                  ("/embed", {"inputs": ["a"], "truncate": "yes please"}),
                  ("/api/embed", {"model": MODEL_NAME, "input": [{"text": "a"}]}))

    def _references(self) -> dict:
        return {k: self._openai([k])[0] for k in range(len(TEXTS))}

    def _heavy(self, r: random.Random) -> tuple[str, dict]:
        return "/v1/embeddings", {"model": MODEL_NAME, "input": [TEXTS[-1]] * r.randint(1, 8)}

    def _openai(self, picked: list[int], fmt: str = "float") -> list[np.ndarray]:
        got = self.openai.embeddings.create(model=MODEL_NAME, input=[TEXTS[k] for k in picked],
                                            encoding_format=fmt)
        if [d.index for d in got.data] != list(range(len(picked))):
            raise RuntimeError("the embeddings' indices are out of order")
        if fmt == "base64":  # the client hands back the string as it came
            return [np.frombuffer(base64.b64decode(d.embedding), np.float32) for d in got.data]
        return [np.asarray(d.embedding, np.float32) for d in got.data]

    def openai_embeddings(self, r: random.Random) -> str:
        picked = r.choices(range(len(TEXTS)), k=r.randint(1, 8))
        fmt = r.choice(["float", "base64"])
        self._check(picked, self._openai(picked, fmt), self.refs)
        return f"embeddings, {fmt}, checked (openai)"

    def tei(self, r: random.Random) -> str:
        picked = r.choices(range(len(TEXTS)), k=r.randint(1, 8))
        got = self._posted("/embed", {"inputs": [TEXTS[k] for k in picked], "truncate": True})
        self._check(picked, got, self.refs)
        return "TEI /embed, checked (http)"

    def ollama(self, r: random.Random) -> str:
        picked = r.choices(range(len(TEXTS)), k=r.randint(1, 4))
        got = self._posted("/api/embed", {"model": MODEL_NAME,
                                          "input": [TEXTS[k] for k in picked]})
        self._check(picked, got["embeddings"], self.refs)
        return "Ollama /api/embed, checked (http)"

    def kserve_v1(self, r: random.Random) -> str:
        picked = r.choices(range(len(TEXTS)), k=r.randint(1, 4))
        got = self._posted(f"/v1/models/{MODEL_NAME}:predict",
                           {"instances": [TEXTS[k] for k in picked]})
        self._check(picked, got["predictions"], self.refs)
        return "KServe V1 predict, checked (http)"

    def actions(self):
        return (self.openai_embeddings, self.openai_embeddings, self.tei, self.ollama,
                self.kserve_v1, *super().actions())


def _signature(grpc_port: int) -> tuple[list[str], str]:
    """The served graph's input names and its first output's, as a client reads them."""
    import tritonclient.grpc as tg

    client = tg.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        meta = client.get_model_metadata(MODEL_NAME)
    finally:
        client.close()
    return [t.name for t in meta.inputs], meta.outputs[0].name


def _tensors(client_module, names: list[str], row: list[int], binary: bool = True) -> list:
    """One row of token ids and the graph's other inputs as a tokenizer fills them (a mask of
    ones, token types of zeros, positions counted), for either tritonclient."""
    n = len(row)
    values = {"input_ids": [row], "attention_mask": np.ones((1, n)),
              "token_type_ids": np.zeros((1, n)), "position_ids": np.arange(n)[None]}
    tensors = []
    for name in names:
        value = np.asarray(values[name], np.int64)
        tensors.append(client_module.InferInput(name, list(value.shape), "INT64"))
        if client_module.__name__.endswith("http"):
            tensors[-1].set_data_from_numpy(value, binary_data=binary)
        else:
            tensors[-1].set_data_from_numpy(value)
    return tensors
