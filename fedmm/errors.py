"""Errors raised by the app before any training starts."""


class ConfigError(ValueError):
    """A configuration value is wrong.

    The message always names the config key, the value it got and what is allowed,
    e.g. ``model.name='resnet'`` is not one of ``cnn, lenet, ...``.
    """

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(f"config error: {key}={value!r} is invalid; allowed: {allowed}")
