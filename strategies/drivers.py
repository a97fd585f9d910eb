"""Which driver runs a method's rounds: chosen by the settings, refused where the method does not declare it.

A run's driver is the synchronous round (:class:`strategies.rounds.SyncRound`), the asynchronous
loop (:class:`strategies.asynchronous.AsyncRound`, ``strategy.asynchronous.enabled``) or FedMR's
secure recombination (:class:`strategies.secure_recombination.SecureRound`,
``strategy.secure.enabled``). The settings choose it (:func:`driver_kind`), here only; a method
runs under the drivers it declares (:attr:`strategies.method.Method.drivers`), any other is
refused when the settings are validated (:func:`check_driver`), naming the setting.
"""

from __future__ import annotations

from typing import Any

from fedmm.errors import ConfigError
from strategies.contract import ASYNC, SECURE, SYNC

#: The setting that turns each driver on.
SWITCH = {ASYNC: "strategy.asynchronous.enabled", SECURE: "strategy.secure.enabled"}


def driver_kind(settings: Any) -> str:
    """The driver the settings choose (``StrategySettings.driver``): ``secure``, ``async`` or ``sync``."""
    return settings.driver


def check_driver(settings: Any, method: type, prefix: str = "strategy.") -> None:
    """A :class:`ConfigError` when the settings choose a driver ``method`` does not declare."""
    kind = driver_kind(settings)
    if kind in method.drivers:
        return
    declared = " or ".join(method.drivers)
    if kind == SYNC:
        raise ConfigError(f"{prefix}asynchronous.enabled", False, f"true with strategy={settings.option} (it runs "
                          f"{declared} only)")
    raise ConfigError(SWITCH[kind].replace("strategy.", prefix, 1), True, f"false with strategy={settings.option} (it runs "
                      f"{declared} only: its class declares drivers = {method.drivers!r})")


def driver_for(method: type, settings: Any) -> type:
    """The driver class of ``method`` with ``settings`` (checked: :func:`check_driver`)."""
    check_driver(settings, method)
    kind = driver_kind(settings)
    if kind == ASYNC:
        from strategies.asynchronous import AsyncRound

        return AsyncRound
    if kind == SECURE:
        from strategies.secure_recombination import SecureRound

        return SecureRound
    from strategies.rounds import SyncRound

    return SyncRound


def needs_sizes(settings: Any) -> bool:
    """Whether the asynchronous driver times jobs on the virtual clock from the nodes' sizes."""
    return driver_kind(settings) == ASYNC
