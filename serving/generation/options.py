"""What a server's generation may do (limits, budgets, padding), and the one bucket rule it
pads batches and cache lengths with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tuner.runtime.memory import room


def next_bucket(n: int, buckets: Sequence[int] = ()) -> int:
    """The smallest bucket >= n; past the largest, the next power of two (so the shapes a
    server sees stay few). Every padded shape generation runs comes from here."""
    for b in buckets:
        if b >= n:
            return int(b)
    return 1 << max(0, n - 1).bit_length()


def cache_buckets(limit: int, given: Sequence[int]) -> tuple[int, ...]:
    """Cache-length buckets up to `limit`: the given ones below it, else powers of two from 16."""
    if given:
        return tuple(b for b in given if b < limit) + (limit,)
    out, b = [], 16
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out) + (limit,)


@dataclass(frozen=True)
class GenerateOptions:
    max_streams: int = 32  # streams running at once (decoding or prefilling); more wait
    max_queue: int = 256  # streams waiting; beyond, RESOURCE_EXHAUSTED
    max_tokens: int = 1024  # the most a request may ask for
    default_max_tokens: int = 16
    max_prompt: int | None = None  # default: the cache length less one token
    max_cache_len: int | None = None  # default: the model's positions (else 2048)
    # Tokens one step feeds, decode rows (one each) and prefill chunks together: a long
    # prompt is prefilled in chunks of what is left, so running streams never stall for a
    # whole prompt (chunked prefill, where the graph takes seq > 1 beside a past).
    prefill_tokens: int = 256
    # While streams decode, a step's prefill work costs at most this share of a decode run
    # (measured as it serves): a burst of prompts delays the next token by at most that.
    # None (the default): only prefill_tokens bounds it. The bound trades throughput and
    # first tokens for even inter-token times: served on 2 cores (genai's graph, 3
    # interleaved rounds), 1.0 gave 8 / 32 streams at once 262 / 264 tok/s against 302 /
    # 349 without (prompts trickle in 64-token chunks, each run reading every weight, while
    # the decode batch stays small), README "Generation".
    max_stall: float | None = None
    kv_cache_bytes: int | None = None  # the cache's byte budget; default a share of memory
    kv_cache_share: float = 0.3  # that share of the machine's available memory
    prefix_cache: bool = True  # reuse the cached keys/values of a shared token prefix
    prefix_block: int = 16  # tokens per prefix-cache block
    batch_buckets: tuple[int, ...] = ()  # default: the artifact's
    cache_buckets: tuple[int, ...] = ()  # default: powers of two from 16
    # "bucket": a batch and its past are padded to their buckets when the batch is formed
    # (the shapes a GPU artifact was tuned at); "longest": to the rows and the longest row
    # (any shape runs on a CPU, and every padded position costs time there); "auto":
    # longest on CPU backends. Either way each step's present is the next past as it is.
    pad_to: str = "auto"
    # A graph that reads its mask as lengths (GroupQueryAttention) decodes into preallocated
    # buffers, past and present one buffer (IO binding): no copy of the cache per step.
    share_buffers: bool = True
    # True: batch the streams of a graph whose rows' numbers depend on their neighbours
    # (quantize_dynamic: one activation range per run), trading "each stream what it is
    # alone" for throughput; False (default): such a graph's streams run one at a time
    batch_variance: bool = False
    # Drafts per step by prompt lookup (serving.generation.speculate) while one stream
    # decodes alone: its next tokens guessed from its own earlier tokens and checked in one
    # run; the output is the same. 0: off. 3: a run of 4 tokens costs ~1.2x a run of 1 on a
    # CPU, so a miss costs little (and a stream rests from lookups after misses).
    speculate: int = 3

    def __post_init__(self) -> None:
        for name in ("max_streams", "max_queue", "max_tokens", "default_max_tokens",
                     "prefill_tokens", "prefix_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.speculate < 0:
            raise ValueError(f"speculate must be >= 0, not {self.speculate}")
        for name in ("max_prompt", "max_cache_len", "kv_cache_bytes"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, not {v}")
        if self.max_stall is not None and not self.max_stall > 0:
            raise ValueError(f"max_stall must be > 0 (or None: no bound), not {self.max_stall}")
        if not 0 < self.kv_cache_share <= 1:
            raise ValueError(f"kv_cache_share must be in (0, 1], not {self.kv_cache_share}")
        if self.pad_to not in ("auto", "bucket", "longest"):
            raise ValueError(f"pad_to must be auto, bucket or longest, not {self.pad_to!r}")
        for name in ("batch_buckets", "cache_buckets"):
            v = getattr(self, name)
            if list(v) != sorted(set(v)) or any(b < 1 for b in v):
                raise ValueError(f"{name} must be increasing positive integers, not {list(v)}")


@dataclass(frozen=True)
class CacheBudget:
    """The KV cache's byte budget and where it came from (the server's ready line says it)."""

    bytes: int
    why: str


def cache_budget(options: GenerateOptions) -> CacheBudget:
    """--kv-cache-bytes, else a share of the memory available to this process (its
    container's limit where that leaves less than the machine: tuner.runtime.memory.room),
    else of 4 GiB where neither can be read."""
    if options.kv_cache_bytes:
        return CacheBudget(options.kv_cache_bytes, "--kv-cache-bytes")
    share = f"{options.kv_cache_share:.0%} of"
    found = room()
    if found is None:
        return CacheBudget(int((4 << 30) * options.kv_cache_share),
                           f"{share} 4 GiB: the available memory could not be read")
    return CacheBudget(int(found.bytes * options.kv_cache_share), f"{share} {found.describe()}")
