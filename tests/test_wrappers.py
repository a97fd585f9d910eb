"""Flower's differential-privacy wrappers around a strategy of this package: refused at start,
with the reason and what to use instead (never silently wrong)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)

from fedmm import protocol
from strategies import FedAvg, FedCross, FedMR
from strategies.wrappers import WrapperRefused
from tests.fakes import FakeGrid

WRAPPERS = [
    lambda s: DifferentialPrivacyServerSideFixedClipping(s, noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=4),
    lambda s: DifferentialPrivacyClientSideFixedClipping(s, noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=4),
    lambda s: DifferentialPrivacyServerSideAdaptiveClipping(s, noise_multiplier=0.5, num_sampled_clients=4, clipped_count_stddev=2.0),
    lambda s: DifferentialPrivacyClientSideAdaptiveClipping(s, noise_multiplier=0.5, num_sampled_clients=4, clipped_count_stddev=2.0),
]


def honest(msg: Message, key: str) -> RecordDict:
    model = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True)
    return RecordDict({protocol.ARRAYS: protocol.model_to_record({k: v + 1 for k, v in model.items()}),
                       protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 10.0})})


@pytest.mark.parametrize("wrap", WRAPPERS, ids=["server-fixed", "client-fixed", "server-adaptive", "client-adaptive"])
@pytest.mark.parametrize("method", [FedAvg, FedMR, FedCross])
def test_a_dp_wrapper_is_refused_at_start_with_why_and_what_instead(method: type, wrap) -> None:  # noqa: ANN001
    grid = FakeGrid(honest, num_nodes=4)
    wrapper = wrap(method(4, seed=0))
    arrays = protocol.model_to_record({"w": np.zeros(3, np.float32)})
    with pytest.raises(WrapperRefused) as err:
        wrapper.start(grid, arrays, num_rounds=1, train_config=ConfigRecord({"x": 1}))
    text = str(err.value)
    assert f"{method.__name__} cannot run inside {type(wrapper).__name__}" in text
    assert "the model that node was sent" in text and "never noised" in text  # why
    assert "clip_update_norm" in text and "FedAvg inside the wrapper" in text  # what instead
    assert grid.sent == []  # refused before any message left the server


def test_any_wrapper_running_flowers_loop_is_refused_and_the_method_alone_runs() -> None:
    class Passthrough(Strategy):  # a wrapper that only delegates
        def __init__(self, inner: Strategy) -> None:
            self.inner = inner

        def summary(self) -> None:
            self.inner.summary()

        def configure_train(self, *a):  # noqa: ANN002, ANN202
            return self.inner.configure_train(*a)

        def aggregate_train(self, *a):  # noqa: ANN002, ANN202
            return self.inner.aggregate_train(*a)

        def configure_evaluate(self, *a):  # noqa: ANN002, ANN202
            return self.inner.configure_evaluate(*a)

        def aggregate_evaluate(self, *a):  # noqa: ANN002, ANN202
            return self.inner.aggregate_evaluate(*a)

    arrays = protocol.model_to_record({"w": np.zeros(3, np.float32)})
    with pytest.raises(WrapperRefused, match="skips FedMR's own"):
        Passthrough(FedMR(4, seed=0)).start(FakeGrid(honest, num_nodes=4), arrays, num_rounds=1)
    result = FedMR(4, seed=0).start(FakeGrid(honest, num_nodes=4), arrays, num_rounds=1, final_report=False)
    assert len(result.models) == 4
