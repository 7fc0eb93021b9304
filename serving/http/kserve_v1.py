"""KServe's V1 protocol (TensorFlow Serving's REST API, KServe's default for a predictor and
what its `InferenceRESTClient` speaks unless told `protocol="v2"`):
`POST /v1/models/{m}:predict` with `{"instances": [...]}` (row format: one entry per example)
answered `{"predictions": [...]}`, or `{"inputs": ...}` (columnar: the batch in each tensor)
answered `{"outputs": ...}`. The model list and readiness (`GET /v1/models[/{m}]`) share their
paths with OpenAI's, whose handlers answer both (serving.http.openai_api).

An example is a dict of the graph's input names, or, for a model of one input, that input's
nested list; an encoder with a tokenizer also takes texts, answered as KServe's Hugging Face
runtime answers its task: a sequence classifier's best label id, a token classifier's per
token, an embedding model's sentence embeddings. There are no datatypes in V1:
values take the graph's own. Each row-format example runs as a request of its own, so
examples of different lengths need no padding and the engine batches them as it batches
any requests. An answer of one output is that output itself, else a dict by name (as
TensorFlow Serving answers). A decoder generates through the generate and OpenAI APIs."""

from __future__ import annotations

import asyncio

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.classify import LOGITS
from serving.decoder import DecoderEngine
from serving.embedding import EMBEDDINGS_OUTPUT, embed_texts
from serving.encoder_kind import encoder_kind
from serving.errors import InvalidArgument
from serving.http import codec
from serving.http.classify_api import classifier_of, tagger_of
from serving.http.embeddings_api import pair_outputs

_MOST_INSTANCES = 1024  # one body's examples: each is a request of its own


def _shape(value) -> tuple[int, ...]:
    """The shape a nested list claims along its first elements (checked against numpy's)."""
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        value = value[0] if value else None
    return tuple(shape)


def tensor(name: str, datatype: str, value) -> np.ndarray:
    """A V1 value (a number, a string, or a rectangular nested list of them) as `datatype`."""
    shape, flat = _shape(value), np.asarray(value, dtype=object)
    if flat.shape != shape:
        raise InvalidArgument(f"input '{name}': a nested list whose rows differ in length "
                              f"(a V1 value is rectangular)")
    # V1 has no 'shape' or 'datatype': the nesting gives one, the graph the other
    return codec.typed(name, datatype, shape, flat.reshape(-1).tolist())


def _named(engine, example) -> dict:
    """An example as {input name: value}: a dict already, or the one input's value."""
    specs = engine.model.signature.inputs
    if isinstance(example, dict):
        return example
    if len(specs) != 1:
        raise InvalidArgument(f"the model takes {len(specs)} inputs "
                              f"({', '.join(s.name for s in specs)}): send each example as an "
                              "object of them by name")
    return {specs[0].name: example}


def _feeds(engine, example, batched: bool) -> dict[str, np.ndarray]:
    """One example's (or, columnar, the batch's) feeds in the graph's datatypes."""
    types = {s.name: s.datatype for s in engine.model.signature.inputs}
    feeds = {}
    for name, value in _named(engine, example).items():
        if name not in types:
            raise InvalidArgument(f"unexpected inference input '{name}' for model "
                                  f"'{engine.name}' (it takes {', '.join(types)})")
        array = tensor(name, types[name], value)
        feeds[name] = array if batched else array[None]  # a row-format example: a batch of 1
    return feeds


def _texts(values) -> list[str] | None:
    """The examples as texts when every one is a string, else None."""
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return values
    return None


def _plain(outputs: dict[str, np.ndarray], row: int | None):
    """Outputs as JSON values: one output is itself, more a dict; `row`: that batch row."""
    def value(array: np.ndarray):
        array = array if row is None else array[row]
        if array.dtype == object:
            return np.vectorize(lambda x: x.decode("utf-8", "replace")
                                if isinstance(x, bytes) else x, otypes=[object])(array).tolist()
        return array.tolist()
    values = {name: value(a) for name, a in outputs.items()}
    return next(iter(values.values())) if len(values) == 1 else values


async def _text_predictions(frontend, engine, texts: list[str]) -> list:
    """Texts as KServe's Hugging Face runtime answers them for the model's task: a sequence
    classifier's best label id per text, a token classifier's per token (the special tokens
    included), else the texts' sentence embeddings."""
    kind = encoder_kind(engine)
    if kind in ("classifier", "reranker", "token_classifier"):
        feeds = tagger_of(engine) if kind == "token_classifier" else classifier_of(engine)
        pairs = [feeds.encode(t) for t in texts]
        outputs = await pair_outputs(frontend, engine, feeds, pairs)
        return [o[LOGITS][0].argmax(-1).tolist() for o in outputs]
    return (await frontend.run(embed_texts, engine, texts))[EMBEDDINGS_OUTPUT].tolist()


async def _rows(frontend, engine, instances: list) -> list:
    texts = _texts(instances)
    if texts is not None:  # an encoder's texts: a prediction each
        return await _text_predictions(frontend, engine, texts)
    runs = [frontend.run(engine.infer, _feeds(engine, example, batched=False), [])
            for example in instances]
    return [_plain(outputs, 0) for outputs, _ in await asyncio.gather(*runs)]


async def _columns(frontend, engine, inputs):
    texts = _texts(inputs)
    if texts is not None:
        return await _text_predictions(frontend, engine, texts)
    outputs, _ = await frontend.run(engine.infer, _feeds(engine, inputs, batched=True), [])
    return _plain(outputs, None)


async def predict(frontend, request: Request) -> Response:
    engine = frontend.slot.find(request.path_params["model"])
    if isinstance(engine, DecoderEngine):
        raise InvalidArgument(f"'{engine.name}' is a decoder: it generates through "
                              "/v1/completions, /v1/chat/completions or "
                              f"/v2/models/{engine.name}/generate (KServe V1 predict serves "
                              "tensor models and encoders)")
    body = await frontend.json(request)
    if "instances" in body:
        instances = body["instances"]
        if not isinstance(instances, list) or not 0 < len(instances) <= _MOST_INSTANCES:
            raise InvalidArgument(f"'instances' must be a list of 1 to {_MOST_INSTANCES} "
                                  "examples")
        return JSONResponse({"predictions": await _rows(frontend, engine, instances)})
    if "inputs" in body:
        return JSONResponse({"outputs": await _columns(frontend, engine, body["inputs"])})
    raise InvalidArgument("a KServe V1 body holds 'instances' (a list of examples) or "
                          "'inputs' (the batch by input name)")


ROUTES = [("/v1/models/{model}:predict", ["POST"], "v1/predict", predict, None)]
