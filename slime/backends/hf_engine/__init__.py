"""The built-in `hf` rollout engine: an SGLang-compatible HTTP server on a transformers model.

server.py (FastAPI endpoints), scheduler.py (continuous batching with a KV cache), engine.py (`HFEngine`,
the Ray-actor wrapper that launches the server process). See docs/hf_engine.md.
"""

from slime.backends.hf_engine.engine import HFEngine

__all__ = ["HFEngine"]
