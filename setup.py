from setuptools import find_packages, setup


def _requirements():
    with open("requirements.txt") as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


setup(
    name="slime",
    version="0.1.0",
    description="RL post-training for LLMs: megatron-core / FSDP training, SGLang / built-in engines, Ray.",
    packages=find_packages(include=["slime", "slime.*"]),
    python_requires=">=3.10",
    install_requires=_requirements(),
    extras_require={
        # 0.16.1 is the newest wheel for Python 3.11; GPU machines with Python 3.12 take 0.19.x.
        "megatron": ["megatron-core>=0.16.1"],
        "sglang": ["sglang>=0.5.0"],
        # --use-wandb.
        "wandb": ["wandb==0.31.0"],
        # tools/plot_metrics.py (TensorBoard scalars -> PNG).
        "plot": ["matplotlib==3.11.2"],
        # examples/search-r1/retrieval_server.py (BM25 ranking).
        "examples": ["rank_bm25==0.2.2"],
        # megatron-core runs in the CPU tests through tests/megatron_cpu_shim.py.
        # pytest-xdist: README's test command runs two workers (-n 2 --dist loadfile).
        "test": ["pytest>=8.0", "pytest-timeout>=2.3", "pytest-xdist==3.8.0", "megatron-core>=0.16.1",
                 "matplotlib==3.11.2", "rank_bm25==0.2.2"],
    },
)
