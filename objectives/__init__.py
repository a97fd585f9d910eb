"""Client objectives: the client's half of a method, one module each (see :mod:`objectives.base`)."""
