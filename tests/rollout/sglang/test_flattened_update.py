"""The weight update's bucketed transfer (engine.flatten_buckets, bucket_payloads): what SGLang's scheduler rebuilds
from it (its restricted unpickler, then FlattenedTensorBucket) is every tensor bit for bit, whatever the mix of dtypes
and odd byte sizes, over one or several buckets, one payload per TP rank."""
import pytest
import torch

from tests.rollout.sglang.conftest import sglang_skip_reason

_REASON = sglang_skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def test_scheduler_side_rebuild_is_bitwise():
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    from minite.rollout.sglang.engine import bucket_payloads, flatten_buckets

    g = torch.Generator().manual_seed(0)
    packed = [("codes", torch.randint(0, 256, (3, 5), dtype=torch.uint8, generator=g)),  # 15 bytes: odd offsets
              ("scales", torch.randn(3, 1, generator=g).to(torch.float8_e4m3fn)),
              ("global", torch.tensor(0.37, dtype=torch.float32)),  # 0-dim
              ("norm", torch.randn(7, generator=g).to(torch.bfloat16)),
              ("gs", torch.randn(2, generator=g))]
    for bucket_bytes, n_buckets in ((1 << 30, 1), (16, 4)):  # 16: 12 (fp32) | 14 | 15 | 3 bytes
        buckets = flatten_buckets(packed, bucket_bytes)
        assert len(buckets) == n_buckets
        rebuilt = {}
        for bucket in buckets:
            payloads = bucket_payloads(bucket, 2)
            assert len(payloads) == 2
            for p in payloads:
                data = MultiprocessingSerializer.deserialize(p)  # the restricted unpickler the scheduler uses
                meta = [FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel)
                        for m in data["metadata"]]  # as SGLang's weight updater converts them
                rebuilt.update(FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=meta)
                               .reconstruct_tensors())
        assert sorted(rebuilt) == sorted(n for n, _ in packed)
        for name, t in packed:
            r = rebuilt[name]
            assert r.dtype == t.dtype and r.shape == t.shape
            assert torch.equal(r.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
