"""Continuous batching on a transformers causal LM: the engine's scheduler.

One scheduler thread owns the model. Each iteration is one forward pass, taken under `step_lock`:
- new requests waiting (up to `max_running_requests` in total) are prefilled together: left-padded to a
  common length, with an explicit attention mask and position ids, into a fresh `DynamicCache`; their
  first token is sampled from the last position and the rows are merged into the running batch (the two
  caches are left-padded to a common length and concatenated along the batch dimension);
- otherwise the running batch takes one decode step: each row feeds its last sampled token.
Finished rows leave the batch after every step, and cache columns that have become padding for every
remaining row are trimmed away, so the cache never grows past the longest live sequence.

Sampling is per request: temperature (0 = greedy), top-p, top-k and one `torch.Generator` per request,
seeded from the request's `sampling_seed` and its prompt length (as SGLang's seeded sampler keys its draws by
seed and position: a later turn of a conversation sent with the same seed draws anew), so a request's random
stream depends neither on which other requests share its batch nor on when it arrived. slime's rollout seeds
every sample (slime/rollout/generation.py `sampling_seed`). A request without a seed takes the engine's
`--random-seed` and its arrival number, as SGLang's global generator would: reproducible only when requests
arrive in a fixed order. Logits, log-probs and sampling are fp32. The reported
log-prob is `log_softmax(logits / temperature)` at the chosen token, before top-p / top-k truncation
(raw logits for greedy), the quantity a trainer recomputes from `logits / temperature`. Prompt log-probs
(`logprob_start_len` >= 0) are of the raw logits at any temperature, as SGLang's.

With `deterministic` (the server's `--enable-deterministic-inference`, SGLang's flag) the engine is batch-invariant
the simplest way: it serves one request at a time, each prefilled and decoded alone, so a request's tokens and
log-probs are a function of the request only (SGLang gets the same from batch-invariant kernels). Otherwise the
numbers of a request depend in their last bits (~1e-7 in a log-prob) on the batch it shares: its shape and padding
come from when requests arrive.

With `kv_cache="slots"` the running batch is kept in a preallocated `SlotCache` (slots.py) instead of a
`DynamicCache`, and on CUDA its decode steps are replayed as CUDA graphs; prefill is the same either way.

Overlap schedule (`overlap`, on by default with slots on CUDA; the server's `--disable-overlap-schedule`, SGLang's
flag): a decode step's sampled tokens stay on the device as the next step's input, and the step after it is
launched before the host reads them, so the host's work on step t (copying its tokens back, stop checks, finished
rows) runs while the GPU computes step t+1. A row that finished at step t has been decoded once more by then; that
token is dropped and its draws were from a stream nothing reads again, so every request's tokens and log-probs are
those of the plain schedule. A step still in flight is settled before a prefill, a pause or `exclusive()`, so
weights never change under it.

Requests of one prefill with the same prompt (a GRPO group's n samples) are prefilled once (`shared_prefill`, on
by default): one row per distinct prompt goes through the model, and its KV cache and last logits are copied to
each request of it, which then samples with its own generator. Requests with images share it too when their ids,
images (the processed pixels) and sampled image tokens are the same; other prompts with images go one per forward.

Simplified, compared with SGLang: no prefix (radix) cache beyond identical prompts in one prefill, no paged KV
memory, no chunked prefill; a prefill pauses the running batch for one forward. Prompts that ask for prompt
log-probs are prefilled apart from the others because they need logits at every position. Stop strings
are detected on a decoded tail window of the output; a stop string spread over more tokens than the
window (only possible with tokens that decode to nothing) is missed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from slime.backends.hf_engine.slots import SlotCache, supports_slots, to_device
from slime.backends.hf_engine.vision import vision_positions
from slime.utils.image_tokens import own_embeddings_at, stand_in_id

logger = logging.getLogger(__name__)

MAX_FULL_LOGITS = 2**28  # elements (1 GiB in fp32) of all-position logits in one prefill forward
GREEDY_EPS = 1e-6  # temperatures at or below this are greedy, as in SGLang
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
_SEED_STRIDE = 1_000_003  # keeps (seed, request number) pairs from colliding for any realistic count
# Requests of one rollout arrive as a burst spread over milliseconds. Prefilling each arrival on its own
# costs one forward per handful of requests (measured: 432 forward steps instead of ~6 for 128 requests of
# 4 tokens, 4 s instead of 1 s); so newcomers are admitted once arrivals pause for ADMIT_QUIET_S, or once
# the oldest has waited ADMIT_MAX_WAIT_S, or when they fill the batch.
ADMIT_QUIET_S = 0.005
ADMIT_MAX_WAIT_S = 0.05
UNIFORM_CHUNK = 64  # random draws taken from a request's generator at once (one CPU call per 64 tokens)
SAMPLE_BLOCK = 1024  # vocabulary block of the two-level inverse-CDF sampling in `sample_tokens`


# SGLang sampling knobs this engine does not implement, with the value that means "off". A request that
# turns one on is refused rather than silently served differently.
_UNSUPPORTED = {"n": 1, "min_p": 0.0, "min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                "repetition_penalty": 1.0, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
                "logit_bias": None}


@dataclass
class SamplingParams:
    """The subset of SGLang's `sampling_params` the engine honours; unknown keys are ignored."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """Parse and validate; raises ValueError naming the offending field."""
        d = dict(d or {})
        p = cls()
        for key in ("temperature", "top_p"):
            if d.get(key) is not None:
                setattr(p, key, _number(d[key], key))
        for key in ("top_k", "max_new_tokens", "sampling_seed"):
            if d.get(key) is not None:
                setattr(p, key, _integer(d[key], key))
        for key in ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "ignore_eos"):
            if d.get(key) is not None:
                setattr(p, key, bool(d[key]))
        stop = d.get("stop")
        if stop is not None:
            p.stop = [stop] if isinstance(stop, str) else list(stop)
            if not all(isinstance(s, str) and s for s in p.stop):
                raise ValueError(f"sampling_params.stop must be a non-empty string or a list of them, got {stop!r}")
        if d.get("stop_token_ids") is not None:
            p.stop_token_ids = [_integer(t, "stop_token_ids[]") for t in d["stop_token_ids"]]
        if p.temperature < 0:
            raise ValueError(f"sampling_params.temperature must be >= 0, got {p.temperature}")
        if not 0 < p.top_p <= 1:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {p.top_p}")
        if p.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {p.max_new_tokens}")
        for key, default in _UNSUPPORTED.items():
            if d.get(key) is not None and d[key] != default:
                raise ValueError(f"sampling_params.{key}={d[key]!r} is not supported by the hf engine "
                                 f"(only {default!r}); drop it or use the sglang engine")
        if p.top_k <= 0:
            p.top_k = -1  # SGLang spells "no top-k" as -1; treat 0 the same way
        return p


def _number(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"sampling_params.{name} must be a number, got {v!r}")  # noqa: TRY004 (answered as 400)
    return float(v)


def _integer(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise ValueError(f"sampling_params.{name} must be an integer, got {v!r}")
    return v


@dataclass
class Request:
    """One generation request and, once finished, its result (read the fields after `on_finish`)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    # a vision-language model's image inputs ({"pixel_values", "image_grid_thw", "stray"}, vision.py); input_ids
    # then hold one image token per merged patch of each image, plus sampled image tokens at the `stray` positions
    vision: dict | None = None
    on_finish: Callable[[Request], None] | None = None
    # results
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish_reason: dict | None = None
    error: str | None = None  # set when the engine failed while serving the request
    # scheduler state
    generator: torch.Generator | None = None
    uniforms: list[float] = field(default_factory=list)  # drawn from `generator` ahead of use, consumed in order
    stop_ids: frozenset = frozenset()
    abort_requested: bool = False
    arrival: float = field(default_factory=time.monotonic)

    def next_uniform(self) -> float:
        """The next draw of this request's random stream (drawn UNIFORM_CHUNK at a time: one call per chunk)."""
        if not self.uniforms:
            self.uniforms = torch.rand(UNIFORM_CHUNK, generator=self.generator).tolist()[::-1]
        return self.uniforms.pop()

    @property
    def needs_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def default_stop_token_ids(model, tokenizer) -> set[int]:
    """EOS ids from the generation config, the model config and the tokenizer."""
    ids: set[int] = set()
    sources = [getattr(getattr(model, "generation_config", None), "eos_token_id", None),
               getattr(model.config.get_text_config(), "eos_token_id", None),
               getattr(tokenizer, "eos_token_id", None)]
    for v in sources:
        if v is None:
            continue
        ids.update([v] if isinstance(v, int) else list(v))
    return ids


def sample_tokens(logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor,
                  uniforms: torch.Tensor | None, truncate: bool | None = None,
                  all_truncate: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; returns (tokens, log-probs of the chosen tokens), both [B].

    logits [B, V] fp32; temps [B] (<= GREEDY_EPS: greedy); top_ps [B]; top_ks [B] (<= 0: off);
    uniforms [B] in [0, 1), one draw per row from the row's own generator (ignored for greedy rows;
    None when every row is greedy). Sampling is inverse-CDF on the (truncated, renormalised) distribution.
    `truncate` / `all_truncate`: whether any / every row uses top-p or top-k (computed here when None; the scheduler
    passes them to avoid device syncs).
    """
    greedy = temps <= GREEDY_EPS
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(-1)
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = logp.argmax(dim=-1)
    if uniforms is not None:
        probs = logp.exp()
        vocab = probs.shape[-1]
        if truncate is None:
            truncate = bool((top_ps < 1).any()) or bool((top_ks > 0).any())
        if truncate:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each candidate
            drop = before > top_ps.unsqueeze(-1)  # the top candidate always survives (before == 0)
            ranks = torch.arange(vocab, device=logits.device)
            drop |= (top_ks > 0).unsqueeze(-1) & (ranks.unsqueeze(0) >= top_ks.unsqueeze(-1))
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            cdf = sorted_p.cumsum(dim=-1)
            pick = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True).clamp_(max=vocab - 1)
            sampled = order.gather(-1, pick).squeeze(-1)
            # a row without top-p / top-k draws as it would in a batch where none has them (the sorted order maps
            # a draw to another token): its tokens do not depend on its batch-mates' settings
            untruncated = (top_ps >= 1) & (top_ks <= 0)
            if all_truncate is None:
                all_truncate = not bool(untruncated.any())
            if not all_truncate:
                sampled = torch.where(untruncated, _inverse_cdf(probs, uniforms), sampled)
        else:
            sampled = _inverse_cdf(probs, uniforms)
        tokens = torch.where(greedy, tokens, sampled)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the token i with cdf[i-1] <= u * total < cdf[i], without a cumulative sum over the vocabulary:
    find the block of SAMPLE_BLOCK tokens holding the target from the block masses, then search inside it."""
    rows, vocab = probs.shape
    blocks = -(-vocab // SAMPLE_BLOCK)
    padded = torch.nn.functional.pad(probs, (0, blocks * SAMPLE_BLOCK - vocab)).view(rows, blocks, SAMPLE_BLOCK)
    block_mass = padded.sum(dim=-1)
    block_cdf = block_mass.cumsum(dim=-1)
    target = (uniforms * block_cdf[:, -1]).unsqueeze(-1)
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks - 1)  # [rows, 1]
    inner = padded.gather(1, block.unsqueeze(-1).expand(-1, 1, SAMPLE_BLOCK)).squeeze(1)  # [rows, SAMPLE_BLOCK]
    cdf = inner.cumsum(dim=-1) + (block_cdf.gather(-1, block) - block_mass.gather(-1, block))
    pick = torch.searchsorted(cdf, target, right=True)
    # rounding can put the target past the block's last token with mass; never pick a zero-mass token
    offsets = torch.arange(SAMPLE_BLOCK, device=probs.device)
    last = torch.where(inner > 0, offsets, 0).amax(dim=-1, keepdim=True)
    return (block * SAMPLE_BLOCK + torch.minimum(pick, last)).squeeze(-1)


class _Rows:
    """Per-row sampling parameters of a running batch (`reqs`), as device tensors."""

    reqs: list[Request]

    def refresh_params(self):
        dev = self.device
        self.temps = to_device([r.params.temperature for r in self.reqs], torch.float32, dev)
        self.top_ps = to_device([r.params.top_p for r in self.reqs], torch.float32, dev)
        self.top_ks = to_device([r.params.top_k for r in self.reqs], torch.long, dev)
        self.sampling_rows = [i for i, r in enumerate(self.reqs) if r.params.temperature > GREEDY_EPS]
        truncating = [r.params.top_p < 1 or r.params.top_k > 0 for r in self.reqs]
        self.truncate, self.all_truncate = any(truncating), all(truncating)


class _Batch(_Rows):
    """Rows in a transformers DynamicCache (left-padded), their mask, pending token and position."""

    def __init__(self, reqs, cache, mask, next_tokens, next_pos):
        self.reqs: list[Request] = reqs
        self.cache: DynamicCache = cache  # layers hold keys/values [B, heads, L, head_dim]
        self.mask = mask  # [B, L] long, 0 = padding
        self.device = mask.device
        self.next_tokens = next_tokens  # [B] sampled, not yet in the cache
        self.next_pos = next_pos  # [B] position id of next_tokens
        self.refresh_params()

    def decode_logits(self, model) -> torch.Tensor:
        """One forward of every row's pending token; returns the last-position logits [B, V]."""
        mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        out = model(input_ids=self.next_tokens.unsqueeze(-1), attention_mask=mask,
                    position_ids=self.next_pos.unsqueeze(-1), past_key_values=self.cache, use_cache=True)
        self.mask, self.cache = mask, out.past_key_values
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1]

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def select(self, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.reqs = [self.reqs[i] for i in keep]
        self.mask, self.next_tokens, self.next_pos = self.mask[idx], self.next_tokens[idx], self.next_pos[idx]
        # Columns that are padding in every remaining row are dead weight for every later step.
        first = int(self.mask.any(dim=0).long().argmax())
        self.mask = self.mask[:, first:]
        self.cache = DynamicCache(ddp_cache_data=[(k[idx, :, first:], v[idx, :, first:]) for k, v in self.kv()])
        self.refresh_params()

    def merge(self, other: _Batch) -> None:
        a_len, b_len = self.mask.shape[1], other.mask.shape[1]
        length = max(a_len, b_len)
        kv = []
        for (ka, va), (kb, vb) in zip(self.kv(), other.kv()):
            kv.append((torch.cat([_left_pad(ka, length, 2), _left_pad(kb, length, 2)]),
                       torch.cat([_left_pad(va, length, 2), _left_pad(vb, length, 2)])))
        self.cache = DynamicCache(ddp_cache_data=kv)
        self.mask = torch.cat([_left_pad(self.mask, length, 1), _left_pad(other.mask, length, 1)])
        self.next_tokens = torch.cat([self.next_tokens, other.next_tokens])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.reqs = self.reqs + other.reqs
        self.refresh_params()


def _left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class _SlotBatch(_Rows):
    """Rows in the preallocated `SlotCache` (row i in slot i); built from, and extended by, prefilled `_Batch`es."""

    def __init__(self, slots: SlotCache, first: _Batch):
        self.slots = slots
        self.device = slots.device
        self.reqs: list[Request] = []
        self.lens: list[int] = []  # tokens in the cache per row (host copy of slots.lens)
        self.merge(first)

    @property
    def next_tokens(self) -> torch.Tensor:
        return self.slots.tokens[: len(self.reqs)]

    @next_tokens.setter
    def next_tokens(self, tokens: torch.Tensor) -> None:
        self.slots.tokens[: len(tokens)] = tokens

    def merge(self, other: _Batch) -> None:
        lengths = [len(r.input_ids) for r in other.reqs]
        self.slots.write_prefill(len(self.reqs), other.kv(), lengths, other.next_tokens, other.next_pos)
        self.reqs = self.reqs + other.reqs
        self.lens = self.lens + lengths
        self.refresh_params()

    def select(self, keep: list[int]) -> None:
        self.slots.keep_rows(keep, max(self.lens) + 1)
        self.reqs = [self.reqs[i] for i in keep]
        self.lens = [self.lens[i] for i in keep]
        self.refresh_params()

    def decode_logits(self, model) -> torch.Tensor:
        logits = self.slots.decode(len(self.reqs), max(self.lens))
        self.lens = [n + 1 for n in self.lens]
        return logits


@dataclass
class _InFlight:
    """A decode step of the overlap schedule: its rows and its sampled tokens and log-probs on their way to the
    host (copies into pinned memory, queued behind the step; `read` waits for them)."""

    reqs: list[Request]
    tokens: torch.Tensor
    logps: torch.Tensor
    copied: torch.cuda.Event | None

    @classmethod
    def start(cls, reqs: list[Request], tokens: torch.Tensor, logps: torch.Tensor) -> _InFlight:
        if tokens.device.type != "cuda":
            return cls(reqs, tokens, logps, None)
        tokens, logps = tokens.to("cpu", non_blocking=True), logps.to("cpu", non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(reqs, tokens, logps, copied)

    def read(self) -> tuple[list[int], list[float]]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.tokens.tolist(), self.logps.tolist()


class Scheduler:
    """Batches requests onto one model. Thread-safe `submit` / `abort` / `pause`; one worker thread.

    Use `start()` for the threaded server; unit tests may instead call `run_until_idle()` in-process.
    Weight changes must happen inside `with scheduler.exclusive():` (between two forward steps).
    """

    def __init__(self, model, tokenizer, *, max_running_requests: int = 64, random_seed: int = 0,
                 stop_token_ids: set[int] | None = None, max_context_len: int | None = None,
                 max_prefill_tokens: int = 16384, stop_window_tokens: int = 8, kv_cache: str = "dynamic",
                 cuda_graphs: bool = True, shared_prefill: bool = True, deterministic: bool = False,
                 overlap: bool | None = None, decode_attention: str = "auto", fused_kv_write: bool | None = None):
        self.model = model
        # `deterministic`: batch invariance by serving one request at a time (each prefilled and decoded alone, so its
        # tokens and log-probs do not depend on the requests beside it: batch shape and padding change the float
        # arithmetic by ~1e-7, enough to flip a sampled token now and then); several times slower
        self.deterministic = deterministic
        if deterministic:
            max_running_requests, shared_prefill = 1, False
        self.shared_prefill = shared_prefill  # identical prompts of one prefill go through the model once
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        if self.device.type == "cuda":
            # cuDNN attention builds an execution plan per new (batch, length) shape, ~50 ms each (measured
            # on an H200); decode shapes change every step, so take the other SDPA kernels (process-wide).
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.max_running_requests = max_running_requests
        self.random_seed = random_seed
        self.eos_ids = frozenset(default_stop_token_ids(model, tokenizer) if stop_token_ids is None else stop_token_ids)
        self.max_context_len = max_context_len
        self.max_prefill_tokens = max_prefill_tokens  # padded tokens per prefill forward (one prompt may exceed it)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.stop_window_tokens = stop_window_tokens
        self._slots: SlotCache | None = None
        if kv_cache not in ("dynamic", "slots"):
            raise ValueError(f"kv_cache={kv_cache!r}: choose 'dynamic' or 'slots'")
        if kv_cache == "slots":
            ok, why = supports_slots(model)
            if ok:
                self._slots = SlotCache(model, max_running_requests, cuda_graphs, decode_attention, fused_kv_write)
            else:
                logger.warning("kv cache 'slots' cannot serve this model (%s); using the dynamic cache", why)
        self.kv_cache = "slots" if self._slots is not None else "dynamic"
        # overlap schedule (module docstring): with the slot cache only; None: on CUDA
        self.overlap = self._slots is not None and (self.device.type == "cuda" if overlap is None else overlap)
        self._in_flight: _InFlight | None = None  # the overlap schedule's decode step not yet read by the host
        self.step_lock = threading.Lock()
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._batch: _Batch | None = None
        self._paused_by: set[str] = set()
        self._exclusive_waiters = 0
        self._abort_pending = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._in_prefill: list[Request] = []  # admitted but not yet in the batch (failed together on error)
        self._num_sampled_requests = 0
        self._last_arrival = 0.0
        self.stats = {"max_batch_size_seen": 0, "num_forward_steps": 0, "num_prefill_steps": 0,
                      "num_generated_tokens": 0, "num_finished_requests": 0,
                      "num_prefill_rows": 0, "num_shared_prefill_rows": 0}  # rows forwarded / copied instead

    # ---- public, any thread ----
    def submit(self, req: Request) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError("scheduler is shutting down")
            if req.params.temperature > GREEDY_EPS:
                # Only sampled requests take a number, so greedy ones (e.g. health checks) do not shift
                # the random streams of the requests after them.
                seed = req.params.sampling_seed
                if seed is None:
                    seed = self.random_seed * _SEED_STRIDE + self._num_sampled_requests
                    self._num_sampled_requests += 1
                else:  # the stream starts where the request does: a later turn given the same seed draws anew
                    seed = seed * _SEED_STRIDE + len(req.input_ids)
                req.generator = torch.Generator().manual_seed(seed % (2**63))
            # SGLang's rule: ignore_eos turns off every token-based stop, stop_token_ids included (stop strings
            # still apply).
            req.stop_ids = frozenset() if req.params.ignore_eos else frozenset(req.params.stop_token_ids) | self.eos_ids
            req.arrival = self._last_arrival = time.monotonic()
            self._waiting.append(req)
            self._cv.notify_all()

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Mark matching requests aborted; waiting ones finish now, running ones at the next step."""
        finished, count = [], 0
        with self._cv:
            for req in list(self._waiting):
                if abort_all or req.rid == rid:
                    self._waiting.remove(req)
                    req.finish_reason = {"type": "abort", "message": "aborted by /abort_request"}
                    finished.append(req)
            # Rows being prefilled are in neither list's final place yet; mark them too (dropped next step).
            live = {id(r): r for r in (self._batch.reqs if self._batch else []) + self._in_prefill}
            for req in live.values():
                if (abort_all or req.rid == rid) and not req.finished:
                    req.abort_requested = True
                    count += 1
            self._abort_pending = self._abort_pending or count > 0
            self._cv.notify_all()
        for req in finished:
            self._notify(req)
        return len(finished) + count

    def pause(self, reason: str = "user") -> None:
        """Stop taking forward steps (requests keep waiting); returns once the current step has ended."""
        with self._cv:
            self._paused_by.add(reason)
        with self.step_lock:
            self._settle()

    def resume(self, reason: str = "user") -> None:
        with self._cv:
            self._paused_by.discard(reason)
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return bool(self._paused_by)

    @contextlib.contextmanager
    def exclusive(self):
        """Hold the model between two steps (for weight updates); the worker yields to waiters."""
        with self._cv:
            self._exclusive_waiters += 1
        try:
            with self.step_lock:
                self._settle()
                yield
        finally:
            with self._cv:
                self._exclusive_waiters -= 1
                self._cv.notify_all()

    def drop_graphs(self) -> None:
        """Forget captured CUDA graphs (call inside `exclusive()` when the model's tensors move)."""
        if self._slots is not None:
            self._slots.drop_graphs()

    def free_idle_kv_cache(self) -> bool:
        """Free the slot cache's buffers if no request is running (inside `exclusive()`); True if freed."""
        if self._slots is None or self._batch is not None or not self._slots.allocated:
            return False
        self._slots.free()
        return True

    def counts(self) -> tuple[int, int]:
        """(running, waiting) request counts. Running counts the rows being prefilled too (they have left the
        waiting queue and are not in the batch yet) and the requests of a paused batch, which stay in it."""
        with self._cv:
            running = {id(r) for r in (self._batch.reqs if self._batch else [])}
            running.update(id(r) for r in self._in_prefill if not r.finished)
            return len(running), len(self._waiting)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="hf-engine-scheduler", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self.abort(abort_all=True)
        with self.step_lock:
            self._drop_aborted()

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        """Step in the calling thread until nothing is waiting or running (tests, no worker thread)."""
        for _ in range(max_steps):
            if not self._has_work():
                return
            with self.step_lock:
                self.step()
        raise RuntimeError(f"run_until_idle: still busy after {max_steps} steps")

    # ---- worker ----
    def _has_work(self) -> bool:
        if self._abort_pending:
            return True
        return not self._paused_by and (bool(self._waiting) or self._batch is not None)

    def _admission_delay(self) -> float:
        """Seconds to hold newcomers back so a burst is prefilled together (0: admit now). Holds _cv."""
        if not self._waiting:
            return 0.0
        room = self.max_running_requests - (len(self._batch.reqs) if self._batch else 0)
        if len(self._waiting) >= room:
            return 0.0
        now = time.monotonic()
        quiet = self._last_arrival + ADMIT_QUIET_S - now
        oldest = self._waiting[0].arrival + ADMIT_MAX_WAIT_S - now
        return max(0.0, min(quiet, oldest))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping:
                    if self._exclusive_waiters > 0 or not self._has_work():
                        self._cv.wait()
                    elif self._batch is None and not self._abort_pending and self._admission_delay() > 0:
                        self._cv.wait(timeout=self._admission_delay())
                    else:
                        break
                if self._stopping:
                    return
            with self.step_lock:
                try:
                    self.step()
                except Exception as e:  # noqa: BLE001 (keep serving: fail the affected requests, drop the batch)
                    logger.error("engine step failed:\n%s", traceback.format_exc())
                    self._fail_all(f"{type(e).__name__}: {e}")

    def step(self) -> None:
        """One iteration: finish aborted rows; then one prefill of newcomers or one decode step."""
        self._drop_aborted()
        if self._paused_by:
            self._settle()
            return
        with self._cv:
            room = self.max_running_requests - (len(self._batch.reqs) if self._batch else 0)
            if self._batch is not None and self._admission_delay() > 0:
                room = 0  # keep decoding the running batch while the burst of newcomers completes
            new, longest = [], 0
            # Admit in arrival order while the left-padded prefill stays within the token budget.
            while self._waiting and len(new) < room:
                longest_next = max(longest, len(self._waiting[0].input_ids))
                if new and longest_next * (len(new) + 1) > self.max_prefill_tokens:
                    break
                new.append(self._waiting.popleft())
                longest = longest_next
            self._in_prefill = new
        if new:
            self._settle()
            self._prefill(new)
            self._in_prefill = []
        elif self._batch is not None:
            self._decode()

    def _drop_aborted(self) -> None:
        with self._cv:
            self._abort_pending = False
        if self._batch is None:
            return
        done = [r for r in self._batch.reqs if r.abort_requested]
        for r in done:
            r.finish_reason = {"type": "abort", "message": "aborted by /abort_request"}
        if done:
            self._remove_finished()
            for r in done:
                self._notify(r)

    @torch.no_grad()
    def _prefill(self, new: list[Request]) -> None:
        ready = []
        with_images: dict[object, list[Request]] = {}  # identical requests with images share a prefill
        for r in new:
            if r.params.max_new_tokens == 0 and not r.needs_input_logprobs:
                r.finish_reason = {"type": "length", "length": 0}
                self._notify(r)
            elif r.vision is not None:
                with_images.setdefault(self._image_prompt_key(r), []).append(r)
            else:
                ready.append(r)
        for group in with_images.values():
            self._prefill_group(group)  # images: a prefill of their own (see _prefill_group)
        # Prompt log-probs need logits at every position: keep those rows apart so the rest stay cheap,
        # and split them so one forward's [rows, length, vocab] logits stay under MAX_FULL_LOGITS.
        full, group, longest = [], [], 0
        for r in (r for r in ready if r.needs_input_logprobs):
            longest_next = max(longest, len(r.input_ids))
            if group and (len(group) + 1) * longest_next * self.vocab_size > MAX_FULL_LOGITS:
                full.append(group)
                group, longest_next = [], len(r.input_ids)
            group.append(r)
            longest = longest_next
        for g in full + [group, [r for r in ready if not r.needs_input_logprobs]]:
            if g:
                self._prefill_group(g)

    def _image_prompt_key(self, r: Request) -> object:
        """What makes two requests with images one prefill: the same ids, images and sampled image tokens (a GRPO
        group's samples); with shared prefill off, or prompt log-probs asked for, each request alone."""
        if not self.shared_prefill or r.needs_input_logprobs:
            return r.rid, id(r)
        v = r.vision
        pixels = v["pixel_values"].detach().cpu().contiguous()
        digest = hashlib.blake2b(pixels.view(torch.uint8).numpy().tobytes(), digest_size=16).digest()
        return (tuple(r.input_ids), tuple(v["image_grid_thw"].flatten().tolist()), tuple(v.get("stray") or ()),
                str(pixels.dtype), tuple(pixels.shape), digest)

    def _prefill_group(self, group: list[Request]) -> None:
        dev = self.device
        full = group[0].needs_input_logprobs
        # row of each request among the distinct prompts (all distinct when sharing is off, or with prompt
        # log-probs, which are per request)
        distinct: dict[tuple[int, ...], int] = {}
        if self.shared_prefill and not full:
            row_of = [distinct.setdefault(tuple(r.input_ids), len(distinct)) for r in group]
        else:
            row_of = list(range(len(group)))
        prompts = list(distinct) if distinct else [r.input_ids for r in group]
        length = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), length, dtype=torch.long)
        mask = torch.zeros(len(prompts), length, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            n = len(prompt)
            ids[i, length - n:] = torch.tensor(prompt, dtype=torch.long)
            mask[i, length - n:] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp_(min=0)
        model_pos, images, model_ids, stray = pos, {}, ids, None
        image_token = getattr(self.model.config, "image_token_id", None)
        vision = group[0].vision
        if vision is not None:
            # One prompt alone (its image embeddings and 3-D RoPE positions are its own; identical requests, a
            # GRPO group's samples, share its one row, copied below as text prompts are). Every token after the
            # prompt has equal temporal/row/column positions, one past the prompt's largest, so from the first
            # decode step on the row is an ordinary one: `pos` (its 1-D positions) continues from there.
            # Image tokens the policy sampled in earlier turns (`stray`) are ordinary tokens: a stand-in id keeps
            # them from taking image features or 3-D positions, and their own embedding is put back.
            if vision.get("stray"):
                stray = torch.zeros_like(ids, dtype=torch.bool)
                stray[0, vision["stray"]] = True  # alone in its row: no left padding
                model_ids = ids.masked_fill(stray, stand_in_id(image_token))
            grid = vision["image_grid_thw"].to(dev)
            model_pos = vision_positions(self.model, model_ids, mask, grid)
            pos = model_pos[0]
            images = {"pixel_values": vision["pixel_values"].to(dev, self.model.dtype), "image_grid_thw": grid}
        own = contextlib.nullcontext() if stray is None else own_embeddings_at(self.model, stray, image_token)
        with own:
            out = self.model(input_ids=model_ids, attention_mask=mask, position_ids=model_pos,
                             past_key_values=DynamicCache(), use_cache=True, logits_to_keep=0 if full else 1, **images)
        self.stats["num_forward_steps"] += 1
        self.stats["num_prefill_steps"] += 1
        self.stats["num_prefill_rows"] += len(prompts)
        self.stats["num_shared_prefill_rows"] += len(group) - len(prompts)
        logits, cache = out.logits, out.past_key_values
        if len(prompts) < len(group):  # each request gets a copy of its prompt's row
            index = torch.tensor(row_of, dtype=torch.long, device=dev)
            cache = DynamicCache(ddp_cache_data=[(layer.keys[index], layer.values[index]) for layer in cache.layers])
            logits, ids, mask, pos = logits[index], ids[index], mask[index], pos[index]
        if full:
            for i, r in enumerate(group):
                r.input_logprobs = self._prompt_logprobs(logits[i], r, length)
        batch = _Batch(group, cache, mask, ids[:, -1], pos[:, -1] + 1)
        self._sample_and_advance(batch, logits[:, -1].float())
        if not batch.reqs:
            return
        if self._batch is None:
            self._batch = _SlotBatch(self._slots, batch) if self._slots is not None else batch
        else:
            self._batch.merge(batch)
        self.stats["max_batch_size_seen"] = max(self.stats["max_batch_size_seen"], len(self._batch.reqs))

    def _prompt_logprobs(self, logits: torch.Tensor, r: Request, length: int) -> list[float | None]:
        """log_softmax of the raw logits at each prompt token from `logprob_start_len` on, the first `None`.
        The sampling temperature does not enter: SGLang applies it only when sampling, so its prompt log-probs
        are the model's own distribution whatever the request's temperature."""
        n, start = len(r.input_ids), r.logprob_start_len
        offset = length - n
        # logits at padded position offset+j-1 predict prompt token j; entries j = start+1 .. n-1
        rows = logits[offset + start: length - 1].float()
        targets = torch.tensor(r.input_ids[start + 1:], dtype=torch.long, device=rows.device)
        vals = torch.log_softmax(rows, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()
        return [None] + vals

    @torch.no_grad()
    def _decode(self) -> None:
        b = self._batch
        logits = b.decode_logits(self.model)
        self.stats["num_forward_steps"] += 1
        if self._slots is not None:
            self.stats["num_cuda_graphs"] = self._slots.stats["graphs_captured"]
        tokens, logps = self._sample(b, logits.float())
        if not self.overlap:
            self._advance(b, b.reqs, tokens.tolist(), logps.tolist())
        else:
            # this step's tokens are the next step's input already (on the device); read the previous step's now
            previous, self._in_flight = self._in_flight, _InFlight.start(list(b.reqs), tokens, logps)
            if previous is not None:
                self._advance(b, previous.reqs, *previous.read())
        if not b.reqs:
            self._batch = self._in_flight = None  # the step in flight has only finished rows

    @torch.no_grad()
    def _settle(self) -> None:
        """Read the overlap schedule's step in flight, if any (holds step_lock)."""
        flight, self._in_flight = self._in_flight, None
        if flight is None or self._batch is None:
            return
        self._advance(self._batch, flight.reqs, *flight.read())
        if not self._batch.reqs:
            self._batch = None

    def _sample_and_advance(self, b: _Batch, logits: torch.Tensor) -> None:
        """Sample one token per row of `b`, record it, finish rows that are done, drop them from `b`."""
        tokens, logps = self._sample(b, logits)
        self._advance(b, b.reqs, tokens.tolist(), logps.tolist())

    def _sample(self, b: _Batch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row of `b` (each row's pending token from now on) and its log-prob, on the device."""
        uniforms = None
        if b.sampling_rows:
            draws = [0.0] * len(b.reqs)
            for i in b.sampling_rows:
                draws[i] = b.reqs[i].next_uniform()
            uniforms = to_device(draws, torch.float32, logits.device)
        tokens, logps = sample_tokens(logits, b.temps, b.top_ps, b.top_ks, uniforms, b.truncate, b.all_truncate)
        b.next_tokens = tokens
        return tokens, logps

    def _advance(self, b: _Batch, reqs: list[Request], tokens: list[int], logps: list[float]) -> None:
        """Record the token sampled for each of `reqs` (the rows of `b` when the step was taken; rows finished
        since, by an earlier step or an abort, are skipped), then drop the finished rows from `b`."""
        done = []
        for r, tok, lp in zip(reqs, tokens, logps):
            if r.finished:
                continue
            if r.params.max_new_tokens == 0:  # a scoring request: prefill only
                r.finish_reason = {"type": "length", "length": 0}
                done.append(r)
                continue
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            self.stats["num_generated_tokens"] += 1
            reason = self._finish_reason(r, tok)
            if reason is not None:
                r.finish_reason = reason
                done.append(r)
        if done:
            keep = [i for i, r in enumerate(b.reqs) if not r.finished]
            if keep:
                b.select(keep)
            else:
                b.reqs = []
            for r in done:
                self._notify(r)

    def _finish_reason(self, r: Request, tok: int) -> dict | None:
        if tok in r.stop_ids:
            return {"type": "stop", "matched": tok}
        if r.params.stop:
            tail = self.tokenizer.decode(r.output_ids[-self._stop_window(r):],
                                         skip_special_tokens=r.params.skip_special_tokens)
            for s in r.params.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if len(r.output_ids) >= r.params.max_new_tokens:
            return {"type": "length", "length": r.params.max_new_tokens}
        if self.max_context_len is not None and len(r.input_ids) + len(r.output_ids) >= self.max_context_len:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _stop_window(self, r: Request) -> int:
        # a stop string of k characters spans at most k tokens that each decode to >= 1 character
        return max(len(s) for s in r.params.stop) + self.stop_window_tokens

    def _remove_finished(self) -> None:
        b = self._batch
        keep = [i for i, r in enumerate(b.reqs) if not r.finished]
        if keep:
            b.select(keep)
        else:
            self._batch = self._in_flight = None

    def _fail_all(self, message: str) -> None:
        reqs = (self._batch.reqs if self._batch else []) + self._in_prefill
        self._batch = self._in_flight = None
        self._in_prefill = []
        for r in reqs:
            if not r.finished:
                r.error = message
                self._notify(r)

    def _notify(self, req: Request) -> None:
        self.stats["num_finished_requests"] += 1
        if req.on_finish is not None:
            try:
                req.on_finish(req)
            except Exception:  # noqa: BLE001 (a caller's callback must not kill the scheduler)
                logger.error("on_finish callback failed:\n%s", traceback.format_exc())
