"""A BM25 retrieval service over a JSONL corpus, the search engine of the search-r1 example.

    python examples/search-r1/retrieval_server.py --corpus examples/search-r1/data/corpus.jsonl --port 8765

POST /retrieve {"query": str, "topk": int} -> {"passages": [{"id", "title", "text", "score"}, ...]}
(best first, at most topk, only passages sharing a word with the query); GET /health -> {"status": "ok",
"num_passages": n}. Binds 127.0.0.1 unless --host says otherwise.

Simplifications: BM25Okapi (rank_bm25) over lower-cased word tokens of title + text, held in memory; no
dense retriever, no batching endpoint (Search-R1's e5 + FAISS server plays this role at scale).
"""

from __future__ import annotations

import argparse
import json
import re

import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field
from rank_bm25 import BM25Okapi

WORD = re.compile(r"\w+")
MAX_TOPK = 50


def tokenize(text: str) -> list[str]:
    return WORD.findall(text.lower())


def load_corpus(path: str) -> list[dict]:
    passages = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
            if "text" not in row:
                raise ValueError(f"{path}:{lineno}: missing key 'text'")
            passages.append({"id": str(row.get("id", lineno - 1)), "title": str(row.get("title", "")),
                             "text": str(row["text"])})
    if not passages:
        raise ValueError(f"{path}: the corpus is empty")
    return passages


class Retriever:
    def __init__(self, passages: list[dict]):
        self.passages = passages
        self.bm25 = BM25Okapi([tokenize(p["title"] + " " + p["text"]) for p in passages])

    def search(self, query: str, topk: int) -> list[dict]:
        words = tokenize(query)
        if not words:
            return []
        scores = self.bm25.get_scores(words)
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:topk]
        return [{**self.passages[i], "score": float(scores[i])} for i in order if scores[i] > 0]


class RetrieveRequest(BaseModel):
    query: str
    topk: int = Field(default=3, ge=1, le=MAX_TOPK)


def make_app(retriever: Retriever) -> FastAPI:
    app = FastAPI(title="search-r1 BM25 retrieval")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "num_passages": len(retriever.passages)}

    @app.post("/retrieve")
    def retrieve(req: RetrieveRequest) -> dict:
        if not req.query.strip():
            raise HTTPException(status_code=400, detail="query is empty")
        return {"passages": retriever.search(req.query, req.topk)}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="examples/search-r1/data/corpus.jsonl")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    retriever = Retriever(load_corpus(args.corpus))
    print(f"retrieval server: {len(retriever.passages)} passages on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(make_app(retriever), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
