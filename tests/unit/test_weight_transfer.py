"""The update_weights_from_tensor payload: SGLang's flattened-bucket wire format, and refusing other pickles."""

import base64
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.multiprocessing as mp

from slime.weight_sync.buckets import buckets
from slime.weight_sync.tensor_payload import deserialize_bucket, flatten_bucket, serialize_bucket

# unequal sizes and dtypes, so unaligned offsets would appear without padding
NAMED = [
    ("model.embed_tokens.weight", torch.randn(3, 5)),
    ("model.norm.weight", torch.randn(7).to(torch.bfloat16)),
    ("model.layers.0.mlp.gate_proj.weight", torch.randn(2, 3, dtype=torch.float64)),
    ("counts", torch.arange(5, dtype=torch.int64)),
    ("half", torch.randn(1).half()),
]


def assert_same(named, got):
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (name, have) in zip(named, got):
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want), name


def test_round_trip_keeps_names_dtypes_shapes_and_values():
    flat = flatten_bucket(NAMED)
    assert flat.flattened_tensor.dtype == torch.uint8 and flat.flattened_tensor.dim() == 1
    assert all(m.start_idx % 16 == 0 for m in flat.metadata)
    assert [m.numel for m in flat.metadata] == [t.numel() * t.element_size() for _, t in NAMED]
    assert_same(NAMED, deserialize_bucket(serialize_bucket(flat)).unflatten())


def test_payload_opens_in_another_process():
    """The payload carries a shared-memory handle, not the data: a separate process reads the tensors."""
    flat = flatten_bucket(NAMED)
    payload = serialize_bucket(flat)
    code = textwrap.dedent("""
        import sys, torch
        from slime.weight_sync.tensor_payload import deserialize_bucket
        for name, t in deserialize_bucket(sys.stdin.read()).unflatten():
            print(name, float(t.double().sum()))
    """)
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    sums = dict(line.rsplit(" ", 1) for line in out.stdout.strip().splitlines())
    for name, t in NAMED:
        assert float(sums[name]) == pytest.approx(float(t.double().sum()), rel=1e-12)
    del flat


@pytest.mark.parametrize("payload, match", [
    (base64.b64encode(pickle.dumps(os.system)).decode(), "posix.system.*refused"),
    (base64.b64encode(pickle.dumps(["not", "a", "bucket"])).decode(), "expected .*flattened_tensor"),
    ("not base64 at all!", "not a base64 pickle"),
])
def test_other_payloads_are_refused(payload, match):
    with pytest.raises((pickle.UnpicklingError, TypeError, ValueError), match=match):
        deserialize_bucket(payload)


def test_file_descriptor_sharing_is_refused_with_the_fix():
    from multiprocessing.reduction import ForkingPickler
    import io

    strategy = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_descriptor")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump({"flattened_tensor": torch.zeros(4, dtype=torch.uint8), "metadata": []})
    finally:
        mp.set_sharing_strategy(strategy)
    with pytest.raises(pickle.UnpicklingError, match="rebuild_storage_fd.*file_system"):
        deserialize_bucket(base64.b64encode(buf.getvalue()).decode())


def test_buckets_keep_order_and_bounds():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5])]  # 40, 40, 120, 20 bytes
    out = list(buckets(tensors, max_bytes=80))
    assert [[n for n, _ in b] for b in out] == [["t0", "t1"], ["t2"], ["t3"]]


def test_buckets_stream_one_bucket_at_a_time():
    """The next tensor is asked for only after the bucket before it was handed out."""
    made = []

    def tensors():
        for i in range(4):
            made.append(i)
            yield f"t{i}", torch.zeros(10)  # 40 bytes each: two per 80-byte bucket

    stream = buckets(tensors(), max_bytes=80)
    first = next(stream)
    assert [n for n, _ in first] == ["t0", "t1"] and made == [0, 1, 2]  # t2 was read to see t1's bucket is full
    assert [[n for n, _ in b] for b in stream] == [["t2", "t3"]]


# ---- against sglang's own code, where the wheel is importable (CI installs it without its GPU deps) ----
def _sglang():
    pytest.importorskip("sglang")
    try:
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError as e:  # an import-only dependency is missing
        pytest.skip(f"sglang installed but not importable: {e}")
    return MultiprocessingSerializer, FlattenedTensorBucket


def test_sglang_server_reads_our_payload():
    """What SGLang's weight updater does with a flattened_bucket payload: SafeUnpickler, then rebuild."""
    serializer, bucket_cls = _sglang()
    flat = flatten_bucket(NAMED)
    obj = serializer.deserialize(serialize_bucket(flat))
    assert type(obj["metadata"][0]).__module__ == "sglang.srt.weight_sync.tensor_bucket"
    bucket = bucket_cls(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
    assert_same(NAMED, bucket.reconstruct_tensors())


def test_we_read_a_payload_made_by_sglangs_serializer():
    """A trainer that packs with sglang's own FlattenedTensorBucket (as slime does) reaches the hf engine."""
    serializer, bucket_cls = _sglang()
    strategy = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        bucket = bucket_cls(named_tensors=NAMED)  # sglang does not align: the float64 tensor starts at byte 74
        payload = serializer.serialize({"flattened_tensor": bucket.get_flattened_tensor().share_memory_(),
                                        "metadata": bucket.get_metadata()}, output_str=True)
    finally:
        mp.set_sharing_strategy(strategy)
    assert_same(NAMED, deserialize_bucket(payload).unflatten())
