"""The paths Hugging Face's two servers share, answered as the one that serves this kind of
model would answer them (Text Generation Inference for a decoder artifact, Text Embeddings
Inference for an encoder one: an embedding model, a reranker or a classifier), since a client
of either calls them:

  GET  /info   TGI's or TEI's model info (limits, the model's kind: generation, embedding
               with its pooling (splade for a sparse one), reranker or classifier with
               their labels; beyond TEI's kinds, token_classifier with its labels and
               masked_lm with its mask token)
  POST /       TGI: generate, or its stream when `stream` is true (tgi_api.root);
               a classifier: TEI's predict, or for a body with `parameters` Hugging Face's
               Inference API (what InferenceClient.text_classification sends; one list of
               labels per text, as that client reads it; with `candidate_labels`, what its
               zero_shot_classification sends: serving/http/classify_api.py);
               a token classifier: its entities (InferenceClient.token_classification);
               a SPLADE model: TEI's embed_sparse; another masked LM: its fills
               (InferenceClient.fill_mask);
               other encoders, TEI as the body is shaped: `inputs` an object with
               `source_sentence` -> similarity (what InferenceClient.sentence_similarity
               sends), `query` with `texts` -> rerank (a cross-encoder), otherwise embed
               (what InferenceClient.feature_extraction sends)
  GET  /       200 once the model serves, 503 before (TEI's health check there); the body
               {"status": "alive"}, what KServe V1's client reads as the server's liveness

Errors are answered in the shape of the API that took the body."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.decoder import DecoderEngine
from serving.encoder_kind import encoder_kind
from serving.engine import Engine
from serving.http import asr_api, classify_api, rerank_api, tei_api, tgi_api
from serving.http.audio_api import takes_audio
from serving.http.embeddings_api import embedder_of


_APIS = {"sparse": "a SPLADE model: TEI's /embed_sparse",
         "masked_lm": "a masked LM: fill-mask on POST / (InferenceClient.fill_mask)",
         "token_classifier": "a token classifier: its entities on POST / "
                             "(InferenceClient.token_classification)",
         "classifier": "TEI's /predict, vLLM's /classify, POST / "
                       "(InferenceClient.text_classification)",
         "reranker": "a reranker: /rerank, /v1/rerank, /v2/rerank, /score",
         "embedding": "an embedding model: /v1/embeddings, TEI's /embed"}


def text_apis(engine) -> str:
    """What an encoder artifact is, and the HTTP APIs that serve it (for the log line that
    says the model is ready); "" for a decoder or a model of tensors alone."""
    if not isinstance(engine, Engine) or engine.model.folder is None \
            or not (engine.model.folder / "tokenizer.json").is_file():
        return ""
    kind = encoder_kind(engine)
    if kind == "classifier":
        labels = classify_api.classifier_of(engine).labels
        return f"a classifier of {len(labels)} labels ({', '.join(labels)}): {_APIS[kind]}"
    return _APIS[kind]


def _serves_text(frontend) -> bool:
    return isinstance(frontend.slot.find(frontend.slot.name), DecoderEngine)


async def info(frontend, request: Request) -> Response:
    engine = frontend.slot.find(frontend.slot.name)
    if isinstance(engine, DecoderEngine):
        return JSONResponse(tgi_api.info(frontend, engine))
    what = encoder_kind(engine)
    if what == "sparse":  # TEI's --pooling splade
        kind, limit = {"embedding": {"pooling": "splade"}}, tei_api.sparse_of(engine).max_tokens
    elif what in ("classifier", "reranker", "token_classifier"):  # TEI's two kinds of
        # sequence classifier, and in their shape a token classifier (no TEI kind: its own)
        classifier = (classify_api.tagger_of(engine) if what == "token_classifier"
                      else classify_api.classifier_of(engine))
        labels = classifier.labels
        kind = {what: {
            "id2label": {str(i): name for i, name in enumerate(labels)},
            "label2id": {name: i for i, name in enumerate(labels)}}}
        limit = classifier.max_tokens
    elif what == "masked_lm":  # no TEI kind: its own, naming the token its clients mask with
        filler = classify_api.filler_of(engine)
        kind, limit = {what: {"mask_token": filler.mask}}, filler.max_tokens
    else:
        embedder = embedder_of(engine)
        kind, limit = tei_api.embedding_type(embedder), embedder.pooling.max_tokens
    return JSONResponse(tei_api.info(frontend, engine, kind, limit))


async def root(frontend, request: Request) -> Response:
    """`POST /` (and SageMaker's /invocations for a body with `inputs`)."""
    if takes_audio(frontend.slot.find(frontend.slot.name)):  # InferenceClient's speech
        try:
            return await asr_api.recognize(frontend, request)
        except Exception as e:  # noqa: BLE001 - answered in TGI's shape
            return tgi_api.error(e)
    if _serves_text(frontend):
        try:
            return await tgi_api.root(frontend, request)
        except Exception as e:  # noqa: BLE001 - answered in TGI's shape
            return tgi_api.error(e)
    try:
        body = await frontend.json(request)
        kind = encoder_kind(frontend.slot.find(frontend.slot.name))
        if kind == "sparse":  # TEI routes / to embed_sparse for a SPLADE model
            return await tei_api.embed_sparse_body(frontend, body)
        if kind == "masked_lm":  # InferenceClient.fill_mask
            return await classify_api.fill_mask(frontend, body)
        if kind == "token_classifier":  # InferenceClient.token_classification
            return await classify_api.token_classification(frontend, body)
        if kind == "classifier":
            parameters = body.get("parameters")
            if isinstance(parameters, dict) and "candidate_labels" in parameters:
                return await classify_api.zero_shot(frontend, body)  # on an NLI model
            if "parameters" in body:  # huggingface_hub's InferenceClient.text_classification
                return await classify_api.inference_api(frontend, body)
            return await classify_api.predict_body(frontend, body)
        if "query" in body and "texts" in body:
            return await rerank_api.rerank(frontend, request)
        if isinstance(body.get("inputs"), dict):
            return await tei_api.similarity_body(frontend, body)
        return await tei_api.embed_body(frontend, body)
    except Exception as e:  # noqa: BLE001 - answered in TEI's shape
        return tei_api.error(e)


async def health(frontend, request: Request) -> Response:
    ready = frontend.slot.ready()
    return JSONResponse({"status": "alive" if ready else "loading"}, 200 if ready else 503)


ROUTES = [("/", ["POST"], "hf/", root, tei_api.error),
          ("/", ["GET"], "hf/health", health, None),
          ("/info", ["GET"], "hf/info", info, tei_api.error)]
