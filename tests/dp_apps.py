"""This project's ClientApp with Flower's differential-privacy mods, for tests/test_privacy.py
(``simulation.client_app=tests.dp_apps:<name>``)."""

from __future__ import annotations

from flwr.clientapp.mod import LocalDpMod, adaptiveclipping_mod, fixedclipping_mod

from client_app.client_app import build_app

fixed_clipping = build_app(mods=[fixedclipping_mod])
adaptive_clipping = build_app(mods=[adaptiveclipping_mod])
local_dp = build_app(mods=[LocalDpMod(clipping_norm=1.0, sensitivity=1.0, epsilon=8.0, delta=1e-5)])
