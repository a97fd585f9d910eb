"""The array codec of the protocol: the same bytes as Flower's own encoder, decoded without a copy."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fedmm import protocol

ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.array(5, dtype=np.int64),  # 0-d (BatchNorm's num_batches_tracked)
    np.zeros((0, 3), dtype=np.float32),
    np.asfortranarray(np.arange(6.0).reshape(2, 3)),
    np.ones(3, dtype=">f4"),
    np.random.default_rng(0).random((64, 3, 3, 3)).astype(np.float32)[:, ::2],  # not contiguous
]


@pytest.mark.parametrize("value", ARRAYS, ids=range(len(ARRAYS)))
def test_encoding_is_byte_identical_to_flowers_and_decodes_back(value: np.ndarray) -> None:
    ours, flowers = protocol.encode_array(value), Array(np.require(value, requirements="C"))
    assert (ours.data, ours.dtype, ours.shape, ours.stype) == (flowers.data, flowers.dtype, flowers.shape, flowers.stype)
    view = protocol.decode_array(ours)
    assert view.dtype == value.dtype and view.shape == value.shape and np.array_equal(view, value)
    assert not view.flags.writeable  # a view of the record's bytes, never written in place
    copied = protocol.decode_array(ours, copy=True)
    assert copied.flags.writeable and np.array_equal(copied, value)


def test_a_view_shares_the_records_bytes_and_outlives_the_record() -> None:
    record = protocol.model_to_record({"w": np.arange(1000, dtype=np.float32)})
    data = record["w"].data
    model = protocol.record_to_model(record, consume=True, copy=False)
    assert len(record) == 0  # consumed: only the view holds the bytes now
    assert np.shares_memory(model["w"], np.frombuffer(data, dtype=np.uint8))
    assert model["w"][999] == 999


def test_truncated_bytes_are_refused_and_the_reply_rejected() -> None:
    good = protocol.encode_array(np.arange(10, dtype=np.float32))
    bad = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data[:-4])
    with pytest.raises(ValueError, match="data bytes"):
        protocol.decode_array(bad)
    spec = {"w": ((10,), np.dtype(np.float32))}

    class Reply:  # the parts of a Message that decode_train_reply reads
        class metadata:  # noqa: N801
            src_node_id = 7

        def __init__(self, record: ArrayRecord) -> None:
            from flwr.app import MetricRecord, RecordDict

            self.content = RecordDict({"arrays": record, "metrics": MetricRecord({"num-examples": 3})})

        def has_error(self) -> bool:
            return False

    update, reason = protocol.decode_train_reply(Reply(ArrayRecord({"w": bad})), 0, spec, copy=False)
    assert update is None and "could not be decoded" in reason
    update, reason = protocol.decode_train_reply(Reply(ArrayRecord({"w": good})), 0, spec, copy=False)
    assert reason == "" and update.num_examples == 3 and not update.model["w"].flags.writeable
