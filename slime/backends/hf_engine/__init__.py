"""The built-in `hf` rollout engine: an SGLang-compatible HTTP server on a transformers model.

server.py (FastAPI endpoints), scheduler.py (continuous batching with a KV cache), engine.py (`HFEngine`,
the Ray-actor wrapper that launches the server process). See docs/hf_engine.md. The package imports none of them
(the `--dry-run` planner reads slots.py's sizing without the engine actor).
"""
