"""Server-side generation for a decoder exported with its KV cache (and for an
encoder-decoder folder: seq2seq.py), split the way vLLM's v1 engine splits it, each part
small and tested alone (no grpc anywhere here):

    options.py    GenerateOptions, and the one bucket rule generation pads with
    scheduler.py  streams waiting and running; per step a token budget shared by the decode
                  rows and prefill chunks, a cap on running streams, preemption by recompute
    cache.py      the cache's byte budget, each stream's cache, the decode batch written in
                  place, and the prefix cache (blocks keyed by token hashes)
    runner.py     a step plan -> feeds (tuner.gate.decode_step, what the gate proves) -> runs
    output.py     batched sampling, stop ids and strings, min_tokens, incremental text,
                  log-probs, chunks and metrics
    admission.py  submit, cancel, drain and close: what both loops share
    engine.py     the one thread that loops: schedule, run, emit (`Generator`)
    seq2seq.py    an encoder-decoder's loop (`Seq2SeqGenerator`): streams in cohorts
    beams.py      beam search for one stream, as transformers' generate runs it
    beam_decode.py  a decoder's beam searches, each a batch of its own beside the engine's
"""

from serving.generation.admission import Handle
from serving.generation.engine import Generator, GenerationStats
from serving.generation.options import GenerateOptions, next_bucket

__all__ = ["GenerateOptions", "GenerationStats", "Generator", "Handle", "next_bucket"]
