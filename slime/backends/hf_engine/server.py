"""HTTP front of the `hf` engine: the subset of SGLang's native API that slime and sglang-router use.

`python -m slime.backends.hf_engine --model-path DIR --port N` loads a transformers causal LM, starts the
batching `Scheduler` (scheduler.py) in a thread and serves FastAPI on uvicorn. Request and response
shapes follow SGLang's; docs/hf_engine.md lists the endpoints and what is simplified.

Weight updates (`/update_weights_from_tensor`, `/update_weights_from_disk`,
`/update_weights_from_distributed`) validate every name first and then copy into the model's parameters
inside `Scheduler.exclusive()`, i.e. between two forward steps, never during one. Names are the model's
own parameter names (`model.named_parameters()`, which for dense transformers models are the HF
checkpoint names), or the checkpoint's keys, renamed as transformers renames them on load (checkpoint_names.py:
a Qwen2.5-VL's `model.layers.*` / `visual.*` as well as its in-memory `model.language_model.*` / `model.visual.*`),
and a MoE's per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` copied into its part of the fused experts.

The distributed path follows SGLang: `/init_weights_update_group` joins the trainer's process group
(the trainer is rank 0; this server, one TP rank, is `rank_offset`) from a worker thread while the HTTP
call waits, since forming the group blocks until every rank has joined; `/update_weights_from_distributed`
receives the named tensors by broadcast from rank 0, in order, then loads them. Every announced tensor is
received before any check that could refuse the update, so a refused update never leaves the trainer
blocked in a broadcast. gloo groups receive into CPU tensors, nccl groups into the model's device.

With `--api-key` (or the environment variable SLIME_ENGINE_API_KEY, which keeps the key off the command line that
`ps` shows) every endpoint but /health* and /metrics* answers 401 without `Authorization: Bearer <key>`, as
SGLang's `--api-key` does (auth.py).

`/release_memory_occupation` / `/resume_memory_occupation` follow SGLang's memory saver (`_release`, release.py):
on CUDA released weights are freed and come back uninitialised, and generation waits for a complete load.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import glob
import json
import logging
import os
import pickle
import threading
import time
import uuid
from collections import Counter

import torch
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from slime.backends.hf_engine.auth import API_KEY_ENV, APIKeyMiddleware
from slime.backends.hf_engine.checkpoint_names import Slice, checkpoint_name_mapper, checkpoint_slices
from slime.backends.hf_engine.fused_norms import fuse_rms_norms
from slime.backends.hf_engine.fused_projections import join_projections
from slime.backends.hf_engine.fused_rotary import fuse_rotary
from slime.backends.hf_engine.lora import MergedAdapter, add_lora_routes
from slime.backends.hf_engine.release import WeightMemory
from slime.backends.hf_engine.scheduler import Request, SamplingParams, Scheduler
from slime.backends.hf_engine.vision import (image_inputs, is_vision_model, load_processor_for, per_prompt_images,
                                            vision_markers)
from slime.backends.hf_engine.weight_checker import WeightChecker
from slime.weight_sync import group as update_group
from slime.weight_sync.tensor_payload import deserialize_bucket

logger = logging.getLogger("slime.hf_engine")

ENGINE_VERSION = "slime-hf-engine 0.1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEALTH_GENERATE_TIMEOUT_S = 20.0
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's; no tags (or []) means all of them
PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's /pause_generation modes; "abort" is its default
PAUSE_ABORT_WAIT_S = 60.0
WEIGHT_VERSION_MOVED = ("Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
                        "Please use '/model_info' instead.")


class EngineState:
    """Everything the endpoints share: model, tokenizer, scheduler, weight version, released tags.

    `frees_memory`: a release frees memory (on CUDA; on CPU only with --release-memory-on-cpu); the weights are then
    freed, or with `weights_cpu_backup` copied to host memory first, or with `lora_base_cpu_backup` (a LoRA engine:
    the base is frozen) restored from one host copy of the base taken once (`self.weights`, release.py).
    """

    def __init__(self, model, tokenizer, scheduler: Scheduler, *, model_path: str, device: str, dtype: str,
                 weight_version: str = "default", weight_dirs: list[str] | None = None, frees_memory: bool = False,
                 weights_cpu_backup: bool = False, lora_base_cpu_backup: bool = False):
        self.model, self.tokenizer, self.scheduler = model, tokenizer, scheduler
        self.model_path, self.device, self.dtype = model_path, device, dtype
        self.weight_dirs = weight_dirs or [os.path.dirname(os.path.abspath(model_path))]
        self.weight_version = weight_version
        self.released: set[str] = set()
        self.update_groups: dict[str, tuple[object, str]] = {}  # group_name -> (process group, backend)
        self.memory_lock = threading.Lock()  # serialises release / resume / weight loading
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.frees_memory = frees_memory
        backup = "base_backup" if lora_base_cpu_backup else "cpu_backup" if weights_cpu_backup else "free"
        self.weights = WeightMemory(model, backup if frees_memory else "keep")
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.params.update(dict(model.named_buffers(remove_duplicate=False)))
        self.model_name = checkpoint_name_mapper(model, set(self.params))  # Hub spelling -> in-memory name
        # checkpoint keys that are parts of a parameter the model holds fused (MoE experts): key -> its place
        self.slices = checkpoint_slices(model, self.params)
        self.slice_counts = Counter(part.param for part in self.slices.values())  # a fused parameter -> its parts
        self.weight_checker = WeightChecker(self.params)  # POST /weights_checker (--check-weight-update-equal)
        # a LoRA adapter merged into the weights (lora.py), its module names read as a push's
        self.adapter = MergedAdapter(model, self.weights, self.model_name)
        self.processor = load_processor_for(model_path, model)  # None for a text-only model (vision.py)

    def load_named_tensors(self, named: list[tuple[str, torch.Tensor]], source: str) -> int:
        """Copy tensors into the model by name (dtype/device cast); all-or-nothing on bad names/shapes. A checkpoint
        key that is a part of a fused parameter (`self.slices`) is copied into that part."""
        with self.memory_lock:
            if self.weights.freed:
                raise ValueError(f"{source}: the weights are released (their memory is freed); POST "
                                 "/resume_memory_occupation with {\"tags\": [\"weights\"]} before loading them")
            targets = [(n, *self._target(n), t) for n, t in named]  # (pushed name, parameter, its slice or None, t)
            unknown = [p for _, p, _, _ in targets if p not in self.params]
            if unknown:
                valid = sorted(self.params)[:5]
                more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
                raise ValueError(f"{source}: unknown parameter name(s) {unknown[:5]}{more}; names must be the "
                                 f"model's parameter names (e.g. {valid}) or its checkpoint's keys")
            bad = []
            for n, p, s, t in targets:  # a part of a fused parameter has that part's shape
                want = tuple(self.params[p].shape) if s is None else s.size
                if tuple(t.shape) != want:
                    bad.append(f"{p if s is None else n}: got {tuple(t.shape)}, model has {want}")
            if bad:
                raise ValueError(f"{source}: shape mismatch for {bad[:5]}")
            with self.scheduler.exclusive(), torch.no_grad():
                for _, p, s, t in targets:  # a slice's view is taken anew: a release/resume swaps param.data
                    (self.params[p] if s is None else s.of(self.params[p])).copy_(t)
                self.adapter.forget_base()  # loaded weights are the new base; a merged adapter went with the old
            self._note_loaded([self.params[p] for _, p, s, _ in targets if s is None],
                              [(self.params[p], n, self.slice_counts[p]) for n, p, s, _ in targets if s is not None])
        return len(named)

    def _target(self, name: str) -> tuple[str, Slice | None]:
        """The parameter a pushed name writes, and the part of it when the name is a checkpoint key that a conversion
        maps into a part of a fused parameter (else None: the whole parameter)."""
        if name not in self.params and name in self.slices:
            return self.slices[name].param, self.slices[name]
        return self.model_name(name), None

    def _note_loaded(self, tensors: list[torch.Tensor], parts: list[tuple] = ()) -> None:
        """After weights came back uninitialised, generation waits until every parameter has been loaded (`parts`:
        (parameter, the key written, how many keys are parts of it) for the parts of fused parameters written)."""
        if self.weights.complete:
            return
        self.weights.mark_loaded(tensors)
        for param, key, count in parts:
            self.weights.mark_part_loaded(param, key, count)
        if self.weights.complete and "weights" not in self.released:
            logger.info("every parameter has been loaded since the weights were resumed: generating again")
            self.scheduler.resume("released")

    def unavailable(self) -> str | None:
        """Why /generate is refused now (None: it is not)."""
        if "weights" in self.released:
            return ("weights are released (POST /release_memory_occupation); "
                    "POST /resume_memory_occupation before generating")
        missing = self.weights.unloaded
        if missing:
            return (f"the weights came back uninitialised from /resume_memory_occupation (a release frees them, as "
                    f"SGLang's does; start the engine with --enable-weights-cpu-backup to keep a copy) and "
                    f"{len(missing)} of {self.weights.count} parameters have not been loaded since, e.g. "
                    f"{missing[:3]}: push the complete weights (update_weights_from_tensor / "
                    f"update_weights_from_distributed / update_weights_from_disk) before generating")
        return None


def load_model(model_path: str, dtype: str, device: str, fuse_norms: bool = True, fuse_rotary_emb: bool = True,
               join_proj: bool = True):
    """A causal LM, or an image-text-to-text model (vision tower + LM) when config.json has a vision_config. On
    CUDA its RMSNorms run as one fused kernel each unless `fuse_norms` is off (fused_norms.py), its rotary
    embedding as one kernel per tensor unless `fuse_rotary_emb` is off (fused_rotary.py), and its q/k/v and
    gate/up projections as one product each unless `join_proj` is off (fused_projections.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: choose one of {sorted(DTYPES)}")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    vision = getattr(AutoConfig.from_pretrained(model_path), "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(model_path, dtype=DTYPES[dtype]).to(device).eval()
    if fuse_norms and device.startswith("cuda"):
        fuse_rms_norms(model)
    if fuse_rotary_emb and device.startswith("cuda"):
        fuse_rotary(model)
    if join_proj and device.startswith("cuda"):
        join_projections(model)
    return model, tokenizer


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}, "message": message, "success": False}, status_code=status)


def _per_item(value, n: int, name: str) -> list:
    """SGLang batches by making every field a list; a scalar (or a single dict) applies to every item."""
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but the batch has {n} prompts")
        return value
    return [value] * n


def parse_generate(body: dict, state: EngineState) -> tuple[list[Request], bool]:
    """Build scheduler requests from a /generate body; raises ValueError with a client-facing message."""
    if body.get("stream"):
        raise ValueError("stream=true is not supported by the hf engine; send a non-streaming request")
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        batched = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        texts = [None] * len(prompts)
    elif body.get("text") is not None:
        text = body["text"]
        batched = isinstance(text, list)
        texts = text if batched else [text]
        prompts = [state.tokenizer(t)["input_ids"] for t in texts]
    else:
        raise ValueError("/generate needs input_ids (list of token ids) or text")
    n = len(prompts)
    images = per_prompt_images(body.get("image_data"), n, batched)
    if any(images) and state.processor is None:
        raise ValueError(f"image_data was sent but the model at {state.model_path} is text-only (no vision_config "
                         "in its config.json); send text only, or serve a vision-language model")
    vision = [None] * n
    for i, items in enumerate(images):
        if items:
            prompts[i], vision[i] = image_inputs(state.processor, items, vision_markers(state.model), text=texts[i],
                                                 input_ids=None if texts[i] is not None else prompts[i])
        elif state.processor is not None and state.processor.image_token_id in prompts[i]:
            raise ValueError(f"prompt {i} holds image tokens (id {state.processor.image_token_id}) but no image_data "
                             "was sent for it; send its images in image_data")
    params = _per_item(body.get("sampling_params") or {}, n, "sampling_params")
    return_logprob = _per_item(body.get("return_logprob") or False, n, "return_logprob")
    start = body.get("logprob_start_len", -1)
    starts = _per_item(-1 if start is None else start, n, "logprob_start_len")
    rids = _per_item(body.get("rid") or None, n, "rid")
    state.adapter.check_lora_path(_per_item(body.get("lora_path"), n, "lora_path"))
    max_len = state.scheduler.max_context_len
    reqs = []
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if not all(isinstance(t, int) and 0 <= t < state.vocab_size for t in prompt):
            raise ValueError(f"prompt {i}: input_ids must be integers in [0, {state.vocab_size})")
        if max_len is not None and len(prompt) >= max_len:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens; the model's context length is {max_len}")
        sp = SamplingParams.from_dict(params[i])
        s = int(starts[i])
        if return_logprob[i] and s >= len(prompt):
            raise ValueError(f"logprob_start_len {s} must be < the prompt length {len(prompt)}")
        reqs.append(Request(rid=str(rids[i]) if rids[i] is not None else uuid.uuid4().hex, input_ids=list(prompt),
                            params=sp, return_logprob=bool(return_logprob[i]), logprob_start_len=s,
                            vision=vision[i]))
    return reqs, batched


def build_response(req: Request, state: EngineState, return_text_in_logprobs: bool = False) -> dict:
    p, fr = req.params, req.finish_reason
    ids = req.output_ids
    trim_token = fr is not None and fr.get("type") == "stop" and isinstance(fr.get("matched"), int)
    text_ids = ids[:-1] if trim_token and not p.no_stop_trim else ids
    text = state.tokenizer.decode(text_ids, skip_special_tokens=p.skip_special_tokens,
                                  spaces_between_special_tokens=p.spaces_between_special_tokens)
    if fr is not None and fr.get("type") == "stop" and isinstance(fr.get("matched"), str) and not p.no_stop_trim:
        cut = text.find(fr["matched"])
        if cut >= 0:
            text = text[:cut]
    # SGLang 0.5.16's keys for a server without --enable-metrics, speculative decoding or --reasoning-parser, with
    # this engine's values: requests are never retracted (a pause keeps them in place), reasoning tokens are only
    # counted under a reasoning parser, there is no prefix cache (SGLang's details are None without a hit), and
    # one scheduler without data parallelism (SGLang's dp_rank at --dp-size 1 is None).
    meta = {"id": req.rid, "finish_reason": fr, "prompt_tokens": len(req.input_ids),
            "weight_version": state.weight_version, "num_retractions": 0}
    if req.return_logprob:
        tok_text = (lambda t: state.tokenizer.decode([t])) if return_text_in_logprobs else (lambda t: None)
        meta["input_token_logprobs"] = []  # without logprob_start_len, SGLang scores the output only
        if req.input_logprobs is not None:
            reported = input_logprob_ids(req.input_ids[req.logprob_start_len:], reported_vocab_size(state))
            meta["input_token_logprobs"] = [[lp, t, tok_text(t)] for lp, t in zip(req.input_logprobs, reported)]
        meta["output_token_logprobs"] = [[lp, t, tok_text(t)] for lp, t in zip(req.output_logprobs, ids)]
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
    meta.update({"reasoning_tokens": 0, "completion_tokens": len(ids), "cached_tokens": 0,
                 "cached_tokens_details": None, "dp_rank": None,
                 "e2e_latency": time.monotonic() - req.arrival,  # seconds since the request was submitted
                 "response_sent_to_client_ts": time.time()})
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


def reported_vocab_size(state: EngineState) -> int:
    """The vocabulary size SGLang's answers are built with: the model config's (text) `vocab_size`."""
    return int(state.model.config.get_text_config().vocab_size)


def input_logprob_ids(input_ids: list[int], vocab_size: int) -> list[int]:
    """The token ids of `input_token_logprobs` as SGLang 0.5.16 reports them: an id of `vocab_size - 1` or more
    is reported as 0 (SGLang clips them so multimodal placeholder ids, which lie past the vocabulary, can be
    detokenized; the last real id is caught by the same rule). Only the reported id changes: the log-prob at
    that position is the sent token's. Output ids are reported as sampled."""
    return [t if t < vocab_size - 1 else 0 for t in input_ids]


def build_app(state: EngineState, api_key: str | None = None) -> FastAPI:
    """The engine's FastAPI app; with `api_key`, every endpoint but /health* and /metrics* requires it (auth.py)."""
    app = FastAPI(title="slime hf engine")
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    sched = state.scheduler

    async def run_requests(reqs: list[Request], http: HTTPRequest | None) -> bool:
        """Submit, wait; abort them if the client goes away. Returns False on disconnect."""
        loop = asyncio.get_running_loop()
        futs = []
        for r in reqs:
            fut = loop.create_future()
            r.on_finish = lambda req, fut=fut: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))
            futs.append(fut)
            sched.submit(r)
        pending = set(futs)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=1.0)
            if pending and http is not None and await http.is_disconnected():
                for r in reqs:
                    sched.abort(rid=r.rid)
                return False
        return True

    @app.post("/generate")
    async def generate(http: HTTPRequest):
        unavailable = state.unavailable()
        if unavailable:
            return _error(503, unavailable)
        try:
            body = await http.json()
            reqs, batched = parse_generate(body, state)
        except ValueError as e:
            return _error(400, str(e))
        if not await run_requests(reqs, http):
            return _error(499, "client disconnected; request aborted")
        failed = [r.error for r in reqs if r.error]
        if failed:
            return _error(500, f"engine error: {failed[0]}")
        text_lp = bool(body.get("return_text_in_logprobs", False))
        out = [build_response(r, state, text_lp) for r in reqs]
        return out if batched else out[0]

    @app.get("/health")
    async def health():
        if not sched.is_alive():
            return _error(503, "scheduler thread is not running; see the server log")
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate():
        if not sched.is_alive():
            return _error(503, "scheduler thread is not running; see the server log")
        if sched.paused or state.released:
            # Paused on purpose (weight update, memory released): healthy, just not generating now.
            return JSONResponse({"status": "ok", "paused": True})
        req = Request(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                      params=SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
        try:
            await asyncio.wait_for(run_requests([req], None), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            sched.abort(rid=req.rid)
            return _error(503, f"health generation did not finish in {HEALTH_GENERATE_TIMEOUT_S} s")
        if req.error:
            return _error(503, f"health generation failed: {req.error}")
        return JSONResponse({"status": "ok"})

    def model_info():
        config = state.model.config
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": state.weight_version,
                "has_image_understanding": state.processor is not None, "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None)}

    def server_info():
        running, waiting = sched.counts()
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "version": ENGINE_VERSION,
                "engine": "hf", "device": state.device, "dtype": state.dtype,
                "lora_adapter": state.adapter.summary(),  # the merged LoRA adapter, or None (lora.py)
                "enable_lora": True,  # SGLang's flag: this engine always serves adapters
                "max_running_requests": sched.max_running_requests, "random_seed": sched.random_seed,
                "enable_deterministic_inference": sched.deterministic,
                "weight_version": state.weight_version, "num_running_reqs": running, "num_waiting_reqs": waiting,
                "paused": sched.paused, "released_tags": sorted(state.released), "weights_release": state.weights.mode,
                "weights_host_copies": state.weights.host_copies,
                "uninitialised_weights": len(state.weights.unloaded), "tp_size": 1, "dp_size": 1,
                "context_length": sched.max_context_len, **sched.stats, **_cuda_memory(state)}

    app.add_api_route("/model_info", model_info, methods=["GET"])
    app.add_api_route("/server_info", server_info, methods=["GET"])
    for old, new, handler in (("/get_model_info", "/model_info", model_info),
                              ("/get_server_info", "/server_info", server_info)):
        app.add_api_route(old, _deprecated(old, new, handler), methods=["GET"])

    @app.get("/get_load")
    async def get_load():
        """SGLang's shape: one entry per data-parallel rank (this engine has one)."""
        running, waiting = sched.counts()
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": 0,
                 "num_pending_tokens": 0, "ts_tic": time.perf_counter()}]

    @app.get("/get_weight_version")
    @app.get("/weight_version")
    async def get_weight_version():
        # As SGLang 0.5.16 answers: the version is a field of /model_info (and of every /generate's meta_info).
        return JSONResponse({"detail": WEIGHT_VERSION_MOVED}, status_code=404)

    @app.post("/update_weight_version")
    async def update_weight_version(http: HTTPRequest):
        """Restamp the weights without changing them (SGLang's endpoint of the same name)."""
        body = await _json_or_empty(http)
        if body.get("new_version") is None:
            return _error(400, "update_weight_version needs {\"new_version\": \"...\"}")
        if body.get("abort_all_requests"):
            sched.abort(abort_all=True)
        state.weight_version = str(body["new_version"])
        return {"success": True, "message": f"Weight version updated to {state.weight_version}",
                "new_version": state.weight_version}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = 0.0):
        """SGLang's answer: 200 once no request is running or waiting (the hf engine keeps no prefix cache, so
        nothing else happens), else 400; `timeout` seconds: wait that long for the last requests to finish first
        (SGLang 0.5.16's deferred flush). `ServerEngine.wait_idle` relies on it."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            running, waiting = sched.counts()
            if not running and not waiting:
                return PlainTextResponse("Cache flushed.\n")
            if time.monotonic() >= deadline:
                return PlainTextResponse(f"Cache not flushed because there are pending requests. #queue-req: "
                                         f"{waiting}, #running-req: {running}\n", status_code=400)
            await asyncio.sleep(0.01)

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(http: HTTPRequest):
        """SGLang's answer: 200 {"success": true, "message": "Success."}, or 400 with success false and the error
        (compare names every tensor that differs from the snapshot); "checksum" adds ranks / per_engine_checksum."""
        action = (await _json_or_empty(http)).get("action") or "checksum"  # SGLang's default action
        try:
            extra = await run_in_threadpool(_check_weights, state, action)
        except Exception as e:  # noqa: BLE001 - every failure is the answer, as SGLang's
            logger.warning("weights_checker %s: %s", action, e)
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        return JSONResponse({"success": True, "message": "Success.", **(extra or {})})

    @app.post("/abort_request")
    async def abort_request(http: HTTPRequest):
        body = await _json_or_empty(http)
        if not body.get("abort_all") and not body.get("rid"):
            # SGLang ignores it (200) with a warning in its log; so do we, saying what was expected.
            logger.warning("abort_request without rid or abort_all=true aborts nothing: %s", body)
            return Response(status_code=200)
        sched.abort(rid=body.get("rid"), abort_all=bool(body.get("abort_all")))
        return Response(status_code=200)  # SGLang's answer: an empty 200, whether or not the rid was known

    @app.post("/pause_generation")
    async def pause_generation(http: HTTPRequest):
        mode = (await _json_or_empty(http)).get("mode") or "abort"  # SGLang's default mode
        if mode not in PAUSE_MODES:
            return _error(400, f"pause_generation mode {mode!r}: choose one of {list(PAUSE_MODES)}")
        await run_in_threadpool(_pause, sched, mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        sched.resume("user")
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(http: HTTPRequest):
        try:
            tags = _memory_tags(await _json_or_empty(http))
        except ValueError as e:
            return _error(400, str(e))
        busy = _not_idle(sched)
        if busy:  # refused before anything is released: the engine is left exactly as it was
            return _error(409, busy)
        await run_in_threadpool(_release, state, tags)
        return {"success": True, "message": f"released {sorted(tags)}", "released_tags": sorted(state.released)}

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(http: HTTPRequest):
        try:
            tags = _memory_tags(await _json_or_empty(http))
        except ValueError as e:
            return _error(400, str(e))
        await run_in_threadpool(_resume, state, tags)
        return {"success": True, "message": f"resumed {sorted(tags)}", "released_tags": sorted(state.released)}

    add_lora_routes(app, state, check_weight_dir)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(http: HTTPRequest):
        body = await http.json()
        fmt = body.get("load_format") or "flattened_bucket"
        if fmt != "flattened_bucket":
            return _error(400, f"load_format {fmt!r} is not supported by the hf engine; use 'flattened_bucket' "
                               "(SGLang's format: slime.weight_sync.tensor_payload.serialize_bucket(flatten_bucket(named)))")
        payloads = body.get("serialized_named_tensors") or []
        if not payloads:
            return _error(400, "serialized_named_tensors is empty")
        try:
            # One entry per tensor-parallel rank in SGLang; this engine has a single rank.
            n = await run_in_threadpool(lambda: state.load_named_tensors(
                deserialize_bucket(payloads[0]).unflatten(), "update_weights_from_tensor"))
        except (ValueError, TypeError, pickle.UnpicklingError) as e:
            return _error(400, str(e))
        if body.get("weight_version") is not None:
            state.weight_version = str(body["weight_version"])
        return {"success": True, "message": f"updated {n} tensors", "weight_version": state.weight_version}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(http: HTTPRequest):
        body = await http.json()
        path = body.get("model_path")
        try:
            n = await run_in_threadpool(_load_from_disk, state, path)
        except PermissionError as e:
            return _error(403, str(e))
        except (ValueError, FileNotFoundError) as e:
            return _error(400, str(e))
        if body.get("weight_version") is not None:
            state.weight_version = str(body["weight_version"])
        return {"success": True, "message": f"loaded {n} tensors from {path}", "weight_version": state.weight_version}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(http: HTTPRequest):
        body = await _json_or_empty(http)
        try:
            name, backend, pg_args = _parse_group_request(body, state)
        except ValueError as e:
            return _error(400, str(e))
        try:
            pg = await run_in_threadpool(update_group.init_weight_update_group, **pg_args)
        except Exception as e:  # noqa: BLE001 (rendezvous failures and timeouts are answered, not raised)
            return _error(500, f"init_weights_update_group {name!r}: {type(e).__name__}: {e}")
        state.update_groups[name] = (pg, backend)
        return {"success": True, "message": f"joined weight update group {name!r} as rank {pg_args['rank']} "
                                            f"of {pg_args['world_size']} ({backend})"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(http: HTTPRequest):
        body = await _json_or_empty(http)
        try:
            pg, buffers = _parse_distributed_update(body, state)
        except ValueError as e:
            return _error(400, str(e))
        if body.get("abort_all_requests"):
            sched.abort(abort_all=True)

        def receive_and_load() -> int:
            update_group.broadcast_tensors(pg, [t for _, t in buffers])
            return state.load_named_tensors(buffers, "update_weights_from_distributed")

        try:
            n = await run_in_threadpool(receive_and_load)
        except ValueError as e:
            return _error(400, str(e))
        except Exception as e:  # noqa: BLE001 (a broken group: say so, keep serving)
            return _error(500, f"update_weights_from_distributed: {type(e).__name__}: {e}")
        if body.get("weight_version") is not None:
            state.weight_version = str(body["weight_version"])
        return {"success": True, "message": f"updated {n} tensors", "weight_version": state.weight_version}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(http: HTTPRequest):
        name = (await _json_or_empty(http)).get("group_name") or "weight_update_group"
        entry = state.update_groups.pop(name, None)
        if entry is None:
            return _error(400, f"no weight update group named {name!r} (known: {sorted(state.update_groups)})")
        await run_in_threadpool(update_group.destroy_weight_update_group, entry[0])
        return {"success": True, "message": f"destroyed weight update group {name!r}"}

    return app


def _parse_group_request(body: dict, state: EngineState) -> tuple[str, str, dict]:
    """/init_weights_update_group body -> (group name, backend, init_weight_update_group kwargs)."""
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if body.get(k) is None]
    if missing:
        raise ValueError(f"init_weights_update_group needs {missing}")
    name = body.get("group_name") or "weight_update_group"
    backend = body.get("backend") or "nccl"
    if name in state.update_groups:
        raise ValueError(f"weight update group {name!r} exists; POST /destroy_weights_update_group first")
    if backend == "nccl" and not state.device.startswith("cuda"):
        raise ValueError(f"backend 'nccl' needs a CUDA engine; this one runs on {state.device}: use 'gloo'")
    world_size, rank = int(body["world_size"]), int(body["rank_offset"])  # one TP rank: rank_offset + 0
    if not 0 < rank < world_size:
        raise ValueError(f"rank_offset {rank} must be in [1, world_size {world_size}) (the trainer is rank 0)")
    return name, backend, {"master_address": str(body["master_address"]), "master_port": int(body["master_port"]),
                           "rank": rank, "world_size": world_size, "group_name": name, "backend": backend}


def _parse_distributed_update(body: dict, state: EngineState) -> tuple[object, list[tuple[str, torch.Tensor]]]:
    """/update_weights_from_distributed body -> (group, empty receive buffers named like the model's tensors)."""
    name = body.get("group_name") or "weight_update_group"
    if name not in state.update_groups:
        raise ValueError(f"no weight update group named {name!r}; POST /init_weights_update_group first")
    pg, backend = state.update_groups[name]
    names, dtypes, shapes = body.get("names") or [], body.get("dtypes") or [], body.get("shapes") or []
    if not names or not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes must be non-empty lists of one length; got "
                         f"{len(names)}, {len(dtypes)}, {len(shapes)}")
    device = "cpu" if backend == "gloo" else state.device
    buffers = []
    for n, d, s in zip(names, dtypes, shapes):
        dtype = getattr(torch, str(d).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{n}: unknown dtype {d!r} (use torch dtype names such as 'bfloat16')")  # noqa: TRY004 (answered as 400)
        buffers.append((str(n), torch.empty([int(x) for x in s], dtype=dtype, device=device)))
    return pg, buffers


async def _json_or_empty(http: HTTPRequest) -> dict:
    raw = await http.body()
    if not raw:
        return {}
    data = json.loads(raw)
    return data if isinstance(data, dict) else {}


def _deprecated(old: str, new: str, handler):
    """SGLang keeps `old` answering like `new` and logs that it is deprecated; we log it once per path."""
    warned = []

    def route():
        if not warned:
            warned.append(True)
            logger.warning("Endpoint '%s' is deprecated (as in SGLang); use '%s'", old, new)
        return handler()

    return route


def _memory_tags(body: dict) -> set[str]:
    """The tags of a release/resume body; none (or an empty list) means all, as in SGLang."""
    tags = body.get("tags") or list(MEMORY_TAGS)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}; the tags are {list(MEMORY_TAGS)} (none: all of them)")
    return set(tags)


def _not_idle(sched: Scheduler) -> str | None:
    """Why memory cannot be released now (None when the scheduler holds no request). SGLang's scheduler asserts
    it is fully idle when asked to release and its server dies; this engine answers instead, so the caller learns
    what it got wrong. Requests of a generation paused in place count: they keep their place in the batch."""
    running, waiting = sched.counts()
    if not running and not waiting:
        return None
    paused = " (generation is paused; its requests keep their place)" if sched.paused else ""
    return (f"release_memory_occupation refused: the engine is not idle, {running} request(s) running and {waiting} "
            f"waiting{paused}; nothing was released. Finish or abort them first (POST /abort_request "
            "{\"abort_all\": true}), then release; GET /get_load shows the counts. SGLang's scheduler asserts it is "
            "idle here and its server dies.")


def _pause(sched: Scheduler, mode: str) -> None:
    """Stop generating. "abort" (SGLang's default) also aborts every request in flight and returns once they
    have been answered; "in_place" and "retract" keep them, to continue after /continue_generation (this
    engine keeps their KV cache either way)."""
    sched.pause("user")
    if mode != "abort":
        return
    sched.abort(abort_all=True)
    deadline = time.monotonic() + PAUSE_ABORT_WAIT_S
    while sched.counts()[0] and time.monotonic() < deadline:
        time.sleep(0.01)


def check_weight_dir(path: str, allowed: list[str]) -> None:
    """Refuse a folder outside every allowed one (symlinks resolved), so the endpoint cannot read arbitrary files."""
    real = os.path.realpath(path)
    for root in allowed:
        root = os.path.realpath(root)
        if real == root or real.startswith(root + os.sep):
            return
    raise PermissionError(f"update_weights_from_disk: {path!r} is outside the folders this engine may load weights "
                          f"from ({allowed}); start it with --weight-dirs naming its parent (slime: "
                          "SLIME_ENGINE_WEIGHT_DIRS)")


def _load_from_disk(state: EngineState, path: str | None) -> int:
    from safetensors import safe_open

    if not path or not os.path.isdir(path):
        raise FileNotFoundError(f"update_weights_from_disk: model_path {path!r} is not a folder")
    check_weight_dir(path, state.weight_dirs)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"update_weights_from_disk: no *.safetensors files in {path}")
    total = 0
    for f in files:  # one file at a time keeps peak memory at one shard
        with safe_open(f, framework="pt") as sf:
            named = [(k, sf.get_tensor(k)) for k in sf.keys()]  # noqa: SIM118 (safe_open is not a dict)
        total += state.load_named_tensors(named, f"update_weights_from_disk ({f})")
    return total


def _check_weights(state: EngineState, action: str) -> dict | None:
    """Run one weights_checker action between two forward steps (reset_tensors writes the parameters)."""
    with state.memory_lock, state.scheduler.exclusive(), torch.no_grad():
        if state.weights.freed:
            raise RuntimeError(f"weights_checker {action}: the weights are released (their memory is freed); "
                               "POST /resume_memory_occupation with {\"tags\": [\"weights\"]} first")
        return state.weight_checker.handle(action)


def _release(state: EngineState, tags: set[str]) -> None:
    """Release memory by tag, as SGLang's memory saver does where `state.frees_memory` (CUDA, or CPU with
    --release-memory-on-cpu):

    - "weights": the parameters' memory is freed (release.py; buffers stay) and comes back uninitialised on resume,
      so the trainer pushes the complete weights right after resuming them (the training loop does); until every
      parameter has been loaded, /generate answers 503 naming what is missing (SGLang would generate from
      garbage). With --enable-weights-cpu-backup the weights are copied to pinned host memory first (allocated on
      the first release, reused) and copied back on resume. With --lora-base-cpu-backup the host copy is of the
      frozen base, taken once: a release copies nothing, a resume copies the base back and merges the loaded LoRA
      adapter again (lora.py).
    - "kv_cache": the KV slot buffers are freed (the endpoint refuses a release while any request is in the engine,
      as SGLang does, so none is running);
    - "cuda_graph": the captured decode graphs are dropped (captured again when next needed; releasing the weights
      drops them too, since they point at the freed memory).

    Elsewhere (CPU by default) nothing is freed: the weights stay resident with their values. Either way, while
    "weights" is released the scheduler is paused and /generate answers 503.
    """
    start, freed = time.perf_counter(), 0
    with state.memory_lock:
        if "weights" in tags and "weights" not in state.released:
            state.scheduler.pause("released")
            with state.scheduler.exclusive():
                state.scheduler.drop_graphs()
                freed = state.weights.release()
        if "cuda_graph" in tags:
            with state.scheduler.exclusive():
                state.scheduler.drop_graphs()
        if "kv_cache" in tags and state.frees_memory:
            with state.scheduler.exclusive():
                state.scheduler.free_idle_kv_cache()
        state.released |= tags
        if state.device != "cpu" and torch.cuda.is_available():
            _free_cuda_scratch(state)
    logger.info("memory: released %s in %.3f s (weights %s: %.3f GB freed)", sorted(tags),
                time.perf_counter() - start, state.weights.mode, freed / 1e9)


def _cuda_memory(state: EngineState) -> dict[str, int]:
    """torch's own counts of this process's device memory (CUDA only): what a release leaves behind shows here."""
    if state.device == "cpu" or not torch.cuda.is_available():
        return {}
    return {"cuda_allocated_bytes": torch.cuda.memory_allocated(), "cuda_reserved_bytes": torch.cuda.memory_reserved()}


def _free_cuda_scratch(state: EngineState) -> None:
    """Give back what the released engine still holds besides its CUDA context: cuBLAS's per-stream workspaces
    (torch keeps them allocated for the process's life; they are taken again at the next matmul) and the caching
    allocator's free blocks. No graph may point into a workspace, so the graphs go first (every release tag
    drops them already)."""
    with state.scheduler.exclusive():
        state.scheduler.drop_graphs()
        torch.cuda.synchronize()
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
    torch.cuda.empty_cache()


def _resume(state: EngineState, tags: set[str]) -> None:
    """Take released memory back (see `_release`). Weights come back uninitialised unless kept (CPU, or
    --enable-weights-cpu-backup); generation then stays paused until the next complete load."""
    start, allocated = time.perf_counter(), 0
    with state.memory_lock:
        if "weights" in tags and "weights" in state.released:
            with state.scheduler.exclusive():
                allocated = state.weights.resume()
                state.adapter.reapply()  # base_backup: the weights came back as the base
                state.scheduler.drop_graphs()
            if state.weights.complete:
                state.scheduler.resume("released")
        state.released -= tags
    logger.info("memory: resumed %s in %.3f s (weights %s: %.3f GB allocated%s)", sorted(tags),
                time.perf_counter() - start, state.weights.mode, allocated / 1e9,
                "" if state.weights.complete else ", uninitialised until loaded")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m slime.backends.hf_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="HF model folder (config, safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-running-requests", type=int, default=64, help="most requests in one running batch")
    p.add_argument("--max-prefill-tokens", type=int, default=16384,
                   help="padded prompt tokens per prefill forward; newcomers beyond it join at the next step")
    p.add_argument("--random-seed", type=int, default=0, help="per-request generators derive from it")
    p.add_argument("--kv-cache", choices=["dynamic", "slots"], default=None,
                   help="'slots': preallocated KV slots with CUDA-graph decode (default on CUDA); "
                        "'dynamic': a transformers DynamicCache per batch (default on CPU)")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="with --kv-cache slots on CUDA, run decode steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--disable-fused-rms-norm", action="store_true",
                   help="on CUDA, run transformers' RMSNorm modules op by op (default: each as one fused kernel, "
                        "F.rms_norm, where it computes the same; fused_norms.py)")
    p.add_argument("--disable-fused-rotary", action="store_true",
                   help="on CUDA, run transformers' apply_rotary_pos_emb op by op (default: one Triton kernel for the "
                        "query and one for the key, where it computes the same; fused_rotary.py)")
    p.add_argument("--disable-joined-projections", action="store_true",
                   help="on CUDA, multiply by q_proj, k_proj, v_proj (and gate_proj, up_proj) one by one (default: "
                        "one product for each group, its weights in one storage, where it computes the same; "
                        "fused_projections.py)")
    p.add_argument("--decode-attention", choices=["auto", "sdpa", "triton"], default="auto",
                   help="attention of the slot cache's decode steps: sdpa (SDPA over each row's whole column bucket "
                        "under a mask) or triton (one Triton kernel per step and layer that reads only each row's "
                        "live columns, decode_attention.py); auto (default): triton where the slot cache runs on "
                        "CUDA and triton imports, else sdpa")
    p.add_argument("--disable-fused-kv-write", action="store_true",
                   help="with the Triton decode attention, store each decode step's new keys and values by two "
                        "indexed writes a layer (default: that kernel stores them itself, one launch a layer fewer "
                        "each; 7% / 3% faster steps at batch 64 / 256 on an H100)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each decode step's tokens before launching the next (SGLang's flag; default with "
                        "--kv-cache slots on CUDA: the next step is launched first, so the host's work overlaps it)")
    p.add_argument("--disable-shared-prefill", action="store_true",
                   help="prefill every request's prompt itself (default: identical prompts of one prefill, a GRPO "
                        "group's samples, go through the model once)")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant: serve one request at a time, each alone, so its tokens and log-probs do not "
                        "depend on the other requests (SGLang's flag; several times slower)")
    p.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="releasing the weights copies them to host memory (pinned, kept for the next release) and "
                        "resuming copies them back (SGLang's flag); default: released weights are freed and come back "
                        "uninitialised, and /generate answers 503 until the complete weights have been loaded again")
    p.add_argument("--lora-base-cpu-backup", action="store_true",
                   help="for a LoRA engine (its base frozen): one host copy of the base weights (pinned), taken at the "
                        "first release or adapter load and again only after a full-weight load; a release copies "
                        "nothing, a resume copies the base back and merges the loaded adapter again, and adapter "
                        "merges read the base from that copy (no device copy of it). Wins over "
                        "--enable-weights-cpu-backup")
    p.add_argument("--release-memory-on-cpu", action="store_true",
                   help="on --device cpu, free released memory as on CUDA (for tests of that path on machines without "
                        "a GPU; default on CPU: a release frees nothing, the weights keep their values)")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--weight-dirs", nargs="+", default=None,
                   help="folders update_weights_from_disk may read (default: the folder holding --model-path)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help="require 'Authorization: Bearer <key>' on every endpoint but /health* and /metrics* (SGLang's "
                        f"flag); default: ${API_KEY_ENV}, which keeps the key out of `ps`; unset: no authentication")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    cache = args.kv_cache or ("slots" if args.device.startswith("cuda") else "dynamic")
    if args.decode_attention == "triton" and (not args.device.startswith("cuda") or cache != "slots"):
        p.error(f"--decode-attention triton is for the slot cache on CUDA; this engine runs on --device {args.device} "
                f"with --kv-cache {cache}: use --device cuda --kv-cache slots, or drop it")
    return args


# Idle keep-alive connections stay open this long. uvicorn's default (5 s) is shorter than the gap between
# two rollouts (training + weight push), and shorter than the idle timeout of the router's connection pool
# (90 s): the server then closed connections the router was reusing at that moment, the request on it was
# answered "400 Invalid HTTP request" (h11 refuses data on a connection it has closed) or reset, the router
# counted failures, opened its circuit breaker and answered 503 no_available_workers until the rollout failed
# (seen on CPU at rollout 60 of a run whose steps took ~8 s). The client must be the side that closes idle
# connections, so the server waits longer than any client pool.
KEEP_ALIVE_S = 600


def main(argv=None) -> None:
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.enable()  # a hard crash (SIGSEGV, SIGABRT) leaves its Python stack in the engine's log
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    t0 = time.time()
    model, tokenizer = load_model(args.model_path, args.dtype, args.device, not args.disable_fused_rms_norm,
                                  not args.disable_fused_rotary, not args.disable_joined_projections)
    with torch.no_grad():  # warm up kernels so the first request is not the slow one
        model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=args.device))
    if is_vision_model(model):
        logger.info("vision-language model: /generate takes image_data (requests with images prefill alone)")
    max_ctx = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    scheduler = Scheduler(model, tokenizer, max_running_requests=args.max_running_requests,
                          random_seed=args.random_seed, max_context_len=max_ctx,
                          max_prefill_tokens=args.max_prefill_tokens,
                          kv_cache=args.kv_cache or ("slots" if args.device.startswith("cuda") else "dynamic"),
                          cuda_graphs=not args.disable_cuda_graph, shared_prefill=not args.disable_shared_prefill,
                          deterministic=args.enable_deterministic_inference,
                          overlap=False if args.disable_overlap_schedule else None,
                          decode_attention=args.decode_attention,
                          fused_kv_write=False if args.disable_fused_kv_write else None)
    state = EngineState(model, tokenizer, scheduler, model_path=args.model_path, device=args.device,
                        dtype=args.dtype, weight_version=args.weight_version, weight_dirs=args.weight_dirs,
                        frees_memory=args.device != "cpu" or args.release_memory_on_cpu,
                        weights_cpu_backup=args.enable_weights_cpu_backup,
                        lora_base_cpu_backup=args.lora_base_cpu_backup)
    scheduler.start()
    logger.info("loaded %s (%s, %s) in %.1f s; serving on http://%s:%d (pid %d, process group %d)%s", args.model_path,
                args.device, args.dtype, time.time() - t0, args.host, args.port, os.getpid(), os.getpgid(0),
                "; every endpoint but /health* and /metrics* requires the API key" if args.api_key else "")
    try:
        uvicorn.run(build_app(state, args.api_key), host=args.host, port=args.port, log_level="warning",
                    timeout_graceful_shutdown=3, timeout_keep_alive=KEEP_ALIVE_S)
    finally:
        scheduler.stop()
