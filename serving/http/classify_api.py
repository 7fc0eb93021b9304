"""The APIs of an encoder artifact whose graph ends in `logits`, in the shapes clients call
them: a sequence classifier's (serving/classify.py), a token classifier's
(serving/token_classify.py) and a masked LM's (serving/fill_mask.py):

  POST /predict               Text Embeddings Inference's: {"inputs": text | [a, b] (a pair)
                              | [[text] | [a, b], ...] (a batch), "raw_scores": false,
                              "truncate": true, "truncation_direction": "right"} ->
                              [{"score", "label"}, ...] highest first (a list of those for
                              a batch); errors TEI's (422 Validation)
  POST /classify, /v1/classify  vLLM's (and SGLang's): {"model", "input": text | [text],
                              "truncate_prompt_tokens", "use_activation": true} ->
                              {"id", "object": "list", "created", "model", "data": [{"index",
                              "label", "probs", "num_classes"}], "usage"}; errors OpenAI's
  inference_api(...)          Hugging Face's Inference API, what huggingface_hub's
                              `InferenceClient.text_classification` sends to `POST /`
                              (serving/http/hf_routes.py): {"inputs": text | [text],
                              "parameters": {"top_k", "function_to_apply"}} -> a list of
                              [{"label", "score"}] per text, highest first
  token_classification(...)   its token classification (InferenceClient.token_classification:
                              `parameters` with `aggregation_strategy`, `ignore_labels`) ->
                              [{"entity" or "entity_group", "score", "word", "start", "end"}]
                              (serving/token_classify.py)
  fill_mask(...)              its fill-mask on a masked LM (InferenceClient.fill_mask:
                              `parameters` with `top_k`, `targets`) -> [{"score", "token",
                              "token_str", "sequence"}] (serving/fill_mask.py)
  zero_shot(...)              its zero-shot classification on an NLI model (InferenceClient.
                              zero_shot_classification: `parameters` with `candidate_labels`,
                              `multi_label`, `hypothesis_template`) -> [{"label", "score"}]

A classifier's scores are the logits through the function transformers' pipeline applies
for the model (softmax; sigmoid for one label or a multi-label model; none for regression). TEI applies
softmax to every model of several labels; for a multi-label or regression model this server
gives the model's own scores instead. Each text is its own request to the engine, so the
batcher joins them."""

from __future__ import annotations

import time
import uuid
from functools import lru_cache

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.classify import FUNCTIONS, LOGITS, Classifier, Pair, zero_shot_scores
from serving.engine import Engine
from serving.errors import InvalidArgument
from serving.fill_mask import MaskFiller
from serving.http import tei_api
from serving.http.embeddings_api import MAX_INPUTS, encoder_named, pair_outputs
from serving.http.openai_api import error
from serving.http.openai_requests import model_named
from serving.token_classify import STRATEGIES, Tagger


@lru_cache(maxsize=4)
def classifier_of(engine: Engine) -> Classifier:
    return Classifier(engine)


def _sequence(item, where: str) -> tuple[str, str | None]:
    """One TEI sequence: a text, [text] or [a, b] (a pair)."""
    if isinstance(item, str):
        return item, None
    if isinstance(item, list) and len(item) in (1, 2) and all(isinstance(t, str) for t in item):
        return item[0], (item[1] if len(item) == 2 else None)
    raise InvalidArgument(f"{where} must be a string, [string] or a pair [string, string]")


def tei_sequences(raw) -> tuple[list[tuple[str, str | None]], bool]:
    """TEI's `inputs` as it reads them: a string, a pair of strings, or a batch of [text] and
    [a, b] lists (a batch exactly when the first item is itself a list); and whether a batch."""
    if isinstance(raw, list) and raw and isinstance(raw[0], list):
        if len(raw) > MAX_INPUTS:
            raise InvalidArgument(f"'inputs' holds {len(raw)} items; at most {MAX_INPUTS}")
        return [_sequence(x, f"inputs[{i}]") for i, x in enumerate(raw)], True
    if raw == [] or raw == "":
        raise tei_api.Empty("'inputs' cannot be empty")
    return [_sequence(raw, "'inputs'")], False


async def predict_body(frontend, body: dict) -> Response:
    engine = encoder_named(frontend, frontend.slot.name)
    classifier = classifier_of(engine)
    sequences, batch = tei_sequences(body.get("inputs"))
    pairs = classifier.encode_all(sequences, tei_api.flag(body, "truncate", True),
                                  tei_api.from_left(body))
    raw = tei_api.flag(body, "raw_scores", False)
    ranked = [classifier.ranked(classifier.scores(o, "none" if raw else None))
              for o in await pair_outputs(frontend, engine, classifier, pairs)]
    return JSONResponse(ranked if batch else ranked[0])


async def predict(frontend, request: Request) -> Response:
    return await predict_body(frontend, await frontend.json(request))


def _function(parameters: dict) -> str | None:
    function = parameters.get("function_to_apply")
    if function is None:
        return None
    if not isinstance(function, str) or function.lower() not in FUNCTIONS:
        raise InvalidArgument(f"'function_to_apply' must be one of {list(FUNCTIONS)}")
    return function.lower()


def _top(parameters: dict, count: int) -> int:
    top = parameters.get("top_k")
    if top is None:
        return count
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgument("'top_k' must be a positive integer")
    return top


def _parameters(body: dict) -> dict:
    """The Inference API's `parameters` (an object; none given: {})."""
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidArgument("'parameters' must be an object")
    return parameters


def _one_text(body: dict, what: str = "a non-empty string") -> str:
    """The Inference API's `inputs` where a task takes one text."""
    text = body.get("inputs")
    if not isinstance(text, str) or not text:
        raise InvalidArgument(f"'inputs' must be {what}")
    return text


async def inference_api(frontend, body: dict) -> Response:
    """Hugging Face's Inference API for text classification (a body with `parameters`)."""
    parameters = _parameters(body)
    engine = encoder_named(frontend, frontend.slot.name)
    classifier = classifier_of(engine)
    raw = body.get("inputs")
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts or len(texts) > MAX_INPUTS or \
            any(not isinstance(t, str) for t in texts):
        raise InvalidArgument(f"'inputs' must be a string or a list of up to {MAX_INPUTS} "
                              "strings")
    function, top = _function(parameters), _top(parameters, len(classifier.labels))
    pairs = [classifier.encode(t) for t in texts]
    return JSONResponse([classifier.ranked(classifier.scores(o, function), top)
                         for o in await pair_outputs(frontend, engine, classifier, pairs)])


def _candidates(raw) -> list[str]:
    """`candidate_labels`: a list of strings, or one comma-separated string (the pipeline's)."""
    labels = [x.strip() for x in raw.split(",") if x.strip()] if isinstance(raw, str) else raw
    if not isinstance(labels, list) or not labels or len(labels) > MAX_INPUTS or \
            any(not isinstance(x, str) or not x for x in labels):
        raise InvalidArgument(f"'candidate_labels' must be a non-empty list of up to "
                              f"{MAX_INPUTS} non-empty strings")
    return labels


async def zero_shot(frontend, body: dict) -> Response:
    """Hugging Face's Inference API for zero-shot classification (what InferenceClient.
    zero_shot_classification sends: `parameters` with `candidate_labels`), as transformers'
    pipeline computes it on an NLI model: the text paired with each label's hypothesis."""
    parameters, text = _parameters(body), _one_text(body)
    labels = _candidates(parameters.get("candidate_labels"))
    template = parameters.get("hypothesis_template") or "This example is {}."
    if not isinstance(template, str) or template.format(labels[0]) == template:
        raise InvalidArgument("'hypothesis_template' must be a string with a {} where the "
                              "label goes")
    multi = parameters.get("multi_label") or False
    if not isinstance(multi, bool):
        raise InvalidArgument("'multi_label' must be true or false")
    engine = encoder_named(frontend, frontend.slot.name)
    classifier = classifier_of(engine)
    entailment = classifier.entailment()
    pairs = [classifier.encode(text, template.format(x), only_first=True) for x in labels]
    outputs = await pair_outputs(frontend, engine, classifier, pairs)
    scores = zero_shot_scores(np.stack([classifier.logits(o) for o in outputs]), entailment,
                              multi)
    order = sorted(range(len(labels)), key=lambda i: -scores[i])
    return JSONResponse([{"label": labels[i], "score": float(scores[i])} for i in order])


@lru_cache(maxsize=4)
def tagger_of(engine: Engine) -> Tagger:
    return Tagger(engine)


async def token_classification(frontend, body: dict) -> Response:
    """Hugging Face's Inference API for a token classifier (what InferenceClient.
    token_classification sends: `inputs` a text, `parameters` with `aggregation_strategy`,
    `ignore_labels`) -> its entities, as transformers' pipeline finds them."""
    parameters, text = _parameters(body), _one_text(body)
    strategy = parameters.get("aggregation_strategy") or "none"
    if not isinstance(strategy, str) or strategy.lower() not in STRATEGIES:
        raise InvalidArgument(f"'aggregation_strategy' must be one of {list(STRATEGIES)}")
    ignore = parameters.get("ignore_labels")
    if ignore is None:
        ignore = ["O"]
    if not isinstance(ignore, list) or any(not isinstance(x, str) for x in ignore):
        raise InvalidArgument("'ignore_labels' must be a list of labels")
    if parameters.get("stride") is not None:
        raise InvalidArgument("'stride' (running a text longer than the model in overlapping "
                              "windows) is not served: the text is cut to the model's length")
    engine = encoder_named(frontend, frontend.slot.name)
    tagger = tagger_of(engine)
    encoding = tagger.encoding(text)
    [outputs] = await pair_outputs(frontend, engine, tagger, [Pair.of(encoding)])
    return JSONResponse(tagger.entities(text, encoding, outputs[LOGITS][0], strategy.lower(),
                                        tuple(ignore)))


@lru_cache(maxsize=4)
def filler_of(engine: Engine) -> MaskFiller:
    return MaskFiller(engine)


async def fill_mask(frontend, body: dict) -> Response:
    """Hugging Face's Inference API for a masked LM (what InferenceClient.fill_mask sends:
    `inputs` a text with the mask token, `parameters` with `top_k`, `targets`)."""
    parameters = _parameters(body)
    text = _one_text(body, "a non-empty string with the mask token")
    top = parameters.get("top_k", 5)
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgument("'top_k' must be a positive integer")
    targets = parameters.get("targets")
    targets = [targets] if isinstance(targets, str) else targets
    if targets is not None and (not isinstance(targets, list) or not targets
                                or any(not isinstance(t, str) for t in targets)):
        raise InvalidArgument("'targets' must be a string or a list of strings")
    engine = encoder_named(frontend, frontend.slot.name)
    filler = filler_of(engine)
    pair = filler.encode(text)
    filler.masks(pair.ids)  # refused before the model runs when there is none
    [outputs] = await pair_outputs(frontend, engine, filler, [pair])
    return JSONResponse(filler.fills(pair.ids, outputs[LOGITS][0], top,
                                     filler.target_ids(targets) if targets else None))


def activated(body: dict) -> bool:
    """vLLM's `use_activation` (and its older names, `activation` and `softmax`)."""
    for name in ("use_activation", "activation", "softmax"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, bool):
                raise InvalidArgument(f"'{name}' must be true or false")
            return value
    return True


def _kept(body: dict) -> int | None:
    """vLLM's `truncate_prompt_tokens`: keep the last k tokens (-1: the model's length)."""
    k = body.get("truncate_prompt_tokens")
    if k is None or k == -1:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidArgument("'truncate_prompt_tokens' must be a positive integer or -1")
    return k


def _last(pair: Pair, k: int | None) -> Pair:
    if k is None or len(pair.ids) <= k:
        return pair
    return Pair(pair.ids[-k:], pair.types[-k:], True)


async def classify(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    name = model_named(frontend, body)
    engine = encoder_named(frontend, name)
    classifier = classifier_of(engine)
    raw = body.get("input")
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts or any(not isinstance(t, str) or not t
                                                       for t in texts):
        raise InvalidArgument("'input' must be a non-empty string or a non-empty list of "
                              "non-empty strings")
    if len(texts) > MAX_INPUTS:
        raise InvalidArgument(f"'input' holds {len(texts)} items; at most {MAX_INPUTS}")
    activated_, k = activated(body), _kept(body)
    pairs = [_last(classifier.encode(t), k) for t in texts]
    outputs = await pair_outputs(frontend, engine, classifier, pairs)
    data = []
    for i, o in enumerate(outputs):
        probs = classifier.scores(o, None if activated_ else "none")
        data.append({"index": i, "label": classifier.labels[int(probs.argmax())],
                     "probs": probs.tolist(), "num_classes": len(probs)})
    tokens = sum(len(p.ids) for p in pairs)
    return JSONResponse({
        "id": "classify-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
        "model": name, "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None}})


ROUTES = [("/predict", ["POST"], "tei/predict", predict, tei_api.error),
          ("/classify", ["POST"], "classify", classify, error),
          ("/v1/classify", ["POST"], "v1/classify", classify, error)]
