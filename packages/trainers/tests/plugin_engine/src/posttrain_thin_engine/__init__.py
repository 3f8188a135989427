"""A third-party posttrain engine: :mod:`.config` (the registered config class) and :mod:`.engine`."""
